"""Block states, block events and the one transition table.

Rules (docs/design.md, "Block states"):

* every block is in exactly one :class:`BlockState`;
* every change of state is ``TRANSITIONS[state][event]``; a missing key *is* the illegal
  transition, and :func:`next_state` raises :class:`IllegalTransitionError` without
  touching anything;
* states are never derived from other fields (reference counts, hashes) and never
  compared by order.

Only PUBLISHED and OFFLOADED blocks are matchable by a prefix lookup; only VALIDATED or
later blocks may be stored to a tier; QUARANTINED blocks are never matchable and are
zeroed before anyone reuses them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

from kvguard.errors import IllegalTransitionError


class BlockState(enum.Enum):
    # Members are singletons compared by identity; identity hashing keeps the table
    # lookup on the pool's hot path cheap (Enum.__hash__ is a Python-level call).
    __hash__ = object.__hash__

    FREE = "free"
    """No owner, no content of value."""
    ALLOCATED = "allocated"
    """Owned by a request; no scheduled step writes KV into it yet."""
    WRITTEN = "written"
    """A scheduled step writes (or wrote) KV into it; that step is not validated yet."""
    VALIDATED = "validated"
    """Every token in it comes from validated steps; not in the prefix index."""
    PUBLISHED = "published"
    """Validated, full, and its hash is in the prefix index (matchable)."""
    OFFLOADED = "offloaded"
    """Published, and a lower tier acknowledged its copy."""
    QUARANTINED = "quarantined"
    """Written by a failed step, or by one that can never be validated; zeroed before reuse."""


class BlockEvent(enum.Enum):
    __hash__ = object.__hash__

    ALLOCATE = "allocate"
    """Handed to a new owner (from the free queue, zeroed first when suspect)."""
    WRITE = "write"
    """A scheduled step writes tokens into the block."""
    VALIDATE = "validate"
    """Every step that wrote into the block passed validation."""
    PUBLISH = "publish"
    """A full validated block enters the prefix index."""
    ACQUIRE = "acquire"
    """A prefix hit takes a reference on a cached block."""
    STORE_ACK = "store_ack"
    """A lower tier acknowledged its copy of the block."""
    FAIL = "fail"
    """A step that wrote into the block failed validation."""
    RELEASE = "release"
    """The last reference is dropped."""
    EVICT = "evict"
    """A cached block with no reference is reclaimed; its hash leaves the index."""
    INVALIDATE = "invalidate"
    """Its hash was tainted after the fact (corruption found later)."""
    ROLLBACK = "rollback"
    """``zero_request_tail`` wiped the block's tail and gave it back to its owner empty."""


S = BlockState
E = BlockEvent

TRANSITIONS: Mapping[BlockState, Mapping[BlockEvent, BlockState]] = MappingProxyType(
    {
        S.FREE: MappingProxyType({E.ALLOCATE: S.ALLOCATED}),
        S.ALLOCATED: MappingProxyType(
            {
                E.WRITE: S.WRITTEN,
                # Nothing was written by this owner, so nothing suspect is left behind.
                E.RELEASE: S.FREE,
            }
        ),
        S.WRITTEN: MappingProxyType(
            {
                E.WRITE: S.WRITTEN,
                E.VALIDATE: S.VALIDATED,
                E.FAIL: S.QUARANTINED,
                # Released before its step's result arrived (preemption, client abort):
                # the step can never be validated, so its bytes are suspect.
                E.RELEASE: S.QUARANTINED,
                E.ROLLBACK: S.ALLOCATED,
            }
        ),
        S.VALIDATED: MappingProxyType(
            {
                # A partial validated block receives the next step's tokens.
                E.WRITE: S.WRITTEN,
                E.PUBLISH: S.PUBLISHED,
                # Caching off (or a duplicate hash): the tier may still hold a copy.
                E.STORE_ACK: S.VALIDATED,
                E.RELEASE: S.FREE,
                E.ROLLBACK: S.ALLOCATED,
                # A duplicate (or uncached) copy of a hash that was tainted later.
                E.INVALIDATE: S.QUARANTINED,
            }
        ),
        S.PUBLISHED: MappingProxyType(
            {
                E.ACQUIRE: S.PUBLISHED,
                E.STORE_ACK: S.OFFLOADED,
                # Stays matchable with no owner; becomes an eviction candidate.
                E.RELEASE: S.PUBLISHED,
                E.EVICT: S.FREE,
                E.INVALIDATE: S.QUARANTINED,
            }
        ),
        S.OFFLOADED: MappingProxyType(
            {
                E.ACQUIRE: S.OFFLOADED,
                E.STORE_ACK: S.OFFLOADED,
                E.RELEASE: S.OFFLOADED,
                E.EVICT: S.FREE,
                E.INVALIDATE: S.QUARANTINED,
            }
        ),
        S.QUARANTINED: MappingProxyType(
            {
                # Reused first, and zeroed before the new owner's step runs.
                E.ALLOCATE: S.ALLOCATED,
                E.RELEASE: S.QUARANTINED,
                # zero_request_tail may revive a request aborted by a failed step.
                E.ROLLBACK: S.ALLOCATED,
            }
        ),
    }
)

MATCHABLE_STATES: frozenset[BlockState] = frozenset({S.PUBLISHED, S.OFFLOADED})
"""States a prefix lookup may return."""

STORABLE_STATES: frozenset[BlockState] = frozenset({S.VALIDATED, S.PUBLISHED, S.OFFLOADED})
"""States whose bytes may be copied to a lower tier."""


def next_state(block_id: int, state: BlockState, event: BlockEvent) -> BlockState:
    """Return the state ``event`` leads to from ``state``, or raise.

    Raises :class:`IllegalTransitionError` naming the block, the state and the event
    when the table has no entry; the caller changes nothing in that case.
    """
    try:
        return TRANSITIONS[state][event]
    except KeyError:
        raise IllegalTransitionError(block_id, state, event) from None


def mermaid_diagram() -> str:
    """The state diagram of :data:`TRANSITIONS` in Mermaid syntax (docs/states.md)."""
    lines = ["stateDiagram-v2", f"    [*] --> {S.FREE.name}"]
    for state, row in TRANSITIONS.items():
        for event, target in row.items():
            lines.append(f"    {state.name} --> {target.name}: {event.value}")
    return "\n".join(lines)
