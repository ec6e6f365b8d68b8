"""Events the pool emits for the engine to drain with ``take_events()``.

``BlockStored`` is emitted when blocks are *published* (after validation), never when
they are scheduled — consumers such as KV-aware routers therefore only ever learn about
KV that passed its checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvguard.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks entered the prefix index (in prefix order)."""

    request_id: str
    block_hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]
    parent_hash: BlockHash | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left the prefix index (evicted, invalidated, or the cache was reset)."""

    block_hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix index was emptied by ``reset_prefix_cache()``."""


@dataclass(frozen=True, slots=True)
class RequestAborted:
    """A step of this request failed; its unchecked blocks were quarantined."""

    request_id: str
    num_validated_tokens: int
    quarantined: tuple[int, ...]


PoolEvent = BlockStored | BlockRemoved | AllBlocksCleared | RequestAborted
