"""Frozen result objects the pool hands back (no sentinels, no bare tuples)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvguard.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The longest matchable prefix of a request, as found by :meth:`BlockPool.lookup`.

    ``generations`` lets :meth:`BlockPool.allocate` refuse the hit if any block was
    evicted or invalidated between the lookup and the allocation. Only the very object
    the request's latest lookup returned is accepted: a hit kept from before the id
    was freed and reopened, another pool's, a copy or one built by hand is refused.
    """

    request_id: str
    block_ids: tuple[int, ...]
    generations: tuple[int, ...]
    num_tokens: int

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True, slots=True)
class RequestProgress:
    """Where one request's write/validate ledger stands (:meth:`BlockPool.progress`)."""

    request_id: str
    num_blocks: int
    num_written_tokens: int
    num_validated_tokens: int
    num_pending_steps: int
    """Steps whose result is still expected (including ones to be discarded)."""
    aborted: bool


@dataclass(frozen=True, slots=True)
class TokenRange:
    """Half-open token positions ``[start, end)`` of one request."""

    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


class StepOutcome(enum.Enum):
    VALIDATED = "validated"
    """The step passed; its blocks moved to VALIDATED / PUBLISHED."""
    FAILED = "failed"
    """The step failed; the request is aborted and its unchecked blocks quarantined."""
    DISCARDED = "discarded"
    """The result of a step that was in flight when its request was aborted or rolled back."""


@dataclass(frozen=True, slots=True)
class StepResult:
    request_id: str
    outcome: StepOutcome
    tokens: TokenRange
    num_validated_tokens: int
    """The request's validated boundary after this result."""
    published: tuple[int, ...] = ()
    """Block ids that entered the prefix index because of this result."""
    quarantined: tuple[int, ...] = ()
    """Block ids quarantined because of this result."""


@dataclass(frozen=True, slots=True)
class SlotRange:
    """Token slots ``[start, end)`` inside block ``block_id`` that must be wiped."""

    block_id: int
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class TailRollback:
    """What :meth:`BlockPool.zero_request_tail` did to one request."""

    request_id: str
    num_tokens: int
    """The request's token boundary after the rollback: it resumes writing from here."""
    num_tokens_wiped: int
    slots: tuple[SlotRange, ...]
    """The slots queued for wiping (also returned by ``take_slots_to_zero``)."""


@dataclass(frozen=True, slots=True)
class StoreTicket:
    """An in-flight copy of one validated block to a lower tier."""

    ticket_id: int
    block_id: int
    block_hash: BlockHash
    generation: int
    tier: str
    seal: int | None = None
    """The block's seal (the fingerprint of its validated KV), or None: unsealed. The
    copy carries it, and a load of the copy is verified against it."""


@dataclass(frozen=True, slots=True)
class InvalidationReport:
    """What :meth:`BlockPool.invalidate` dropped.

    ``tier_copies`` are (tier, hash) pairs the tiers must purge; ``requests`` hold a
    now-quarantined block in their block table and computed on top of corrupt KV.
    """

    hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]
    tier_copies: tuple[tuple[str, BlockHash], ...]
    requests: tuple[str, ...]


class PublishOutcome(enum.Enum):
    """What :meth:`BlockPool.publish_block` did with a block-level publication."""

    PUBLISHED = "published"
    """The block is in the prefix index now (or already was, under the same hash)."""
    DUPLICATE = "duplicate"
    """Another block holds this hash in the index; this one stays VALIDATED (storable)."""
    DEFERRED = "deferred"
    """A step writing the block is not validated yet: it is published when it is."""


@dataclass(frozen=True, slots=True)
class BlockValidation:
    """What :meth:`BlockPool.validate_blocks` did."""

    validated: tuple[int, ...]
    """Blocks that became VALIDATED (no block-level step writes them any more)."""
    published: tuple[int, ...] = ()
    """Blocks whose deferred publication entered the prefix index now."""
    duplicates: tuple[int, ...] = ()
    """Blocks whose deferred publication found its hash already indexed."""
