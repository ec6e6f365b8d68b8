"""Typed errors.

Two families, never mixed up:

* :class:`PoolMisuseError` — the caller asked for something the pool does not allow
  (unknown request, double free, validating what was never written, ...). The pool is
  left exactly as it was before the call.
* :class:`CorruptionError` — the pool found its own bookkeeping broken
  (:meth:`BlockPool.check_invariants`). This is a bug in kvguard or memory corruption,
  not a caller mistake.

:class:`OutOfBlocksError` is neither: it is the normal "not enough free blocks" answer an
engine turns into preemption or queueing. It also leaves the pool unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvguard.states import BlockEvent, BlockState


class KvGuardError(Exception):
    """Base of every error kvguard raises."""


class PoolMisuseError(KvGuardError, ValueError):
    """The caller broke the pool's contract; nothing was changed."""


class IllegalTransitionError(PoolMisuseError):
    """A block was asked to take an event its state does not allow."""

    def __init__(self, block_id: int, state: BlockState, event: BlockEvent) -> None:
        self.block_id = block_id
        self.state = state
        self.event = event
        super().__init__(
            f"block {block_id} is {state.name}; event {event.name} is not allowed from "
            f"{state.name} (see kvguard.states.TRANSITIONS)"
        )


class UnknownRequestError(PoolMisuseError, KeyError):
    """No request with that id is open in the pool (never added, or freed already).
    Also a ``KeyError``: a lookup by request id fails as a mapping's does, for code that
    catches that."""

    def __init__(self, request_id: str, message: str | None = None) -> None:
        self.request_id = request_id
        super().__init__(
            message
            or f"unknown request {request_id!r}: no request with this id is open in the "
            "pool (never added, or freed already); add_request() opens one"
        )

    def __str__(self) -> str:  # KeyError would otherwise print the repr of args
        return str(self.args[0])


class DuplicateRequestError(PoolMisuseError):
    """A request id was added twice without being freed in between."""


class UnknownBlockError(PoolMisuseError, IndexError):
    """A block id outside ``range(num_blocks)``, or not an int at all."""


class ForeignBlockError(PoolMisuseError):
    """A block-level call named a block it does not hold: a block a request's block
    table holds, or more block-level references than were taken."""


class DoubleFreeError(ForeignBlockError):
    """A block with no reference left was released (again)."""


class NotAllocatedError(PoolMisuseError):
    """A step writes tokens past the blocks the request holds."""


class NoPendingStepError(PoolMisuseError):
    """A validation result arrived for a request that has no step in flight."""


class RequestAbortedError(PoolMisuseError):
    """The request was aborted by a failed step; it can only be freed (or rolled back)."""


class StaleHitError(PoolMisuseError):
    """A prefix hit that is not good for this allocation: one of its blocks was evicted
    or invalidated since the lookup, or it was not looked up for this request as it is
    open now (another request's hit, an earlier request's under the same id, a copy)."""


class NotStorableError(PoolMisuseError):
    """A block was offered to a tier before its KV was validated."""


class UnknownTicketError(PoolMisuseError):
    """A store ticket that is not in flight (acknowledged twice, or never issued)."""


class RollbackError(PoolMisuseError):
    """A tail rollback would wipe KV that other requests can see (a published block)."""


class OutOfBlocksError(KvGuardError):
    """Not enough free or evictable blocks; nothing was allocated."""

    def __init__(self, needed: int, available: int) -> None:
        self.needed = needed
        self.available = available
        super().__init__(
            f"need {needed} blocks, only {available} free or evictable; nothing was "
            "allocated: free or preempt requests (release blocks) and retry"
        )


class CorruptionError(KvGuardError):
    """The pool's own bookkeeping is inconsistent (a kvguard bug, not a caller bug)."""


class InvariantViolation(CorruptionError):
    """:meth:`BlockPool.check_invariants` found a broken invariant."""


class ConsistencyError(CorruptionError):
    """The vLLM adapter found vLLM's view of the pool and kvguard's disagree
    (``GuardedBlockPool.check_consistency``), or its own record of a step out of order:
    a kvguard bug."""


class EngineContractError(CorruptionError):
    """The engine broke a rule the adapter relies on (checked under
    ``check_invariants``; without it the guard quarantines what the rule protected and
    warns): kvguard's model of that engine version is wrong, a kvguard bug to report."""
