"""``recover``: requests whose steps in flight are lost resume from their validated KV.

After a fault (a worker's forward raised, an engine step never reported back) vLLM
aborts every request, and every client loses its answer. The guarded scheduler knows,
for each request, where its validated KV ends: the tokens its steps that reported back
clean computed. :func:`recover` rolls each request back to that boundary instead:

* its computed tokens go back to the boundary (tokens already delivered to the client
  stay delivered: their ids are kept, only KV past the boundary is recomputed), and
  what vLLM keeps per step in flight is dropped (output placeholders under async
  scheduling, draft tokens);
* the blocks past the boundary stay the request's: kvguard's pool rolls them back
  (:meth:`kvguard.BlockPool.roll_back_blocks`), so the slots past the boundary are
  wiped on every worker before the request's next step -- a partial block keeps its
  validated prefix -- and what vLLM had cached of them at schedule time is cached
  again, and published, only when the step recomputing them validates. Full blocks
  below the boundary keep serving prefix hits;
* the steps in flight forget the request, so an output of theirs validates nothing.

A request that cannot resume -- its last steps came back without a NaN count (no
validated boundary is known), a sliding window already freed KV the recomputation
needs, or it holds cross-attention, circular-buffer or Mamba blocks (not laid out by
its tokens: no tail of them can be wiped) -- is ended with ``FINISHED_ERROR`` as vLLM's
abort would, its unvalidated blocks quarantined, and the log says which and why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvguard.errors import PoolMisuseError, RollbackError, UnknownRequestError
from kvguard.results import SlotRange


@dataclass(frozen=True)
class ResumedRequest:
    """A request rolled back by :func:`recover`."""

    request_id: str
    boundary: int
    """Its computed tokens now: the end of its validated KV."""
    rolled_back: int
    """Tokens its lost steps had computed past the boundary: recomputed."""


@dataclass(frozen=True)
class RecoveryReport:
    """What :func:`recover` did."""

    resumed: tuple[ResumedRequest, ...] = ()
    """Requests rolled back to their validated boundary; they resume with the next step."""
    ended: tuple[tuple[Any, str], ...] = ()
    """Requests that could not resume, finished with ``FINISHED_ERROR``: (vLLM's
    ``Request``, why). Their clients still have to be told (vLLM's engine core sends
    the outputs of requests it finished this way, e.g. ``_send_abort_outputs``)."""
    slots: tuple[SlotRange, ...] = field(default=())
    """Token slots the workers wipe before the next step (``kvguard_slots_to_zero``)."""


def requests_to_recover(scheduler: Any, request_ids: Iterable[str] | None) -> list[str]:
    """``request_ids`` checked (each a request the scheduler holds), or by default every
    request with a step in flight."""
    if request_ids is None:
        return scheduler._kvguard_ledger.requests_in_flight()
    if isinstance(request_ids, str):
        raise PoolMisuseError(
            f"recover() takes an iterable of request ids, got the str {request_ids!r}; "
            f"pass [{request_ids!r}]"
        )
    ids = list(request_ids)
    for req_id in ids:
        if not isinstance(req_id, str) or req_id not in scheduler.requests:
            raise UnknownRequestError(
                str(req_id),
                f"recover(): the scheduler holds no request {req_id!r} (finished, or never added)",
            )
    return list(dict.fromkeys(ids))


NOT_ROLLED_BACK: dict[str, str] = {
    # vLLM manager class -> why a request holding blocks of its group cannot roll back
    "CrossAttentionManager": (
        "its cross-attention blocks hold the encoder's KV, laid out by encoder position, "
        "not by its tokens"
    ),
    "CircularBufferManager": (
        "its circular buffer is rewritten in place: the lost steps overwrote KV that "
        "recomputing needs"
    ),
    "MambaManager": (
        "its Mamba state is overwritten in place by every step: the lost steps overwrote "
        "the state that recomputing would start from"
    ),
}


def why_not_resumable(scheduler: Any, request: Any, boundary: int) -> str | None:
    """Why the request cannot resume from ``boundary``, or None."""
    req_id = request.request_id
    if req_id in scheduler._kvguard_unchecked:
        return (
            "its last step(s) came back without a NaN count, so no validated boundary "
            "is known to resume from"
        )
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        blocks = manager.req_to_blocks.get(req_id, ())
        if blocks and type(manager).__name__ in NOT_ROLLED_BACK:
            return NOT_ROLLED_BACK[type(manager).__name__]
        size = manager.block_size
        needed_from = manager.get_num_skipped_tokens(boundary) // size
        for i in range(needed_from, min(boundary // size + 1, len(blocks))):
            if blocks[i].is_null:
                return (
                    f"its {type(manager).__name__} freed KV (block {i}) that recomputing "
                    f"from token {boundary} needs"
                )
    return None


def roll_back_request(scheduler: Any, request: Any, boundary: int) -> None:
    """Roll ``request`` back to ``boundary`` (checked resumable): its KV past it (the
    slots to wipe are queued in kvguard's pool), vLLM's per-step state, and the
    ledger's steps in flight. Raises :class:`~kvguard.errors.RollbackError` having
    changed nothing if kvguard's pool refuses a block (one others can see)."""
    req_id = request.request_id
    old = request.num_computed_tokens
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    tails: dict[int, int] = {}
    for manager in managers:
        blocks = manager.req_to_blocks.get(req_id, ())
        size = manager.block_size
        for i in range(boundary // size, min(-(-old // size), len(blocks))):
            if not blocks[i].is_null:
                block_id = blocks[i].block_id
                tails[block_id] = max(0, boundary - i * size)
    pool = scheduler.kvguard_pool
    pool.core.recovery.roll_back_blocks(tails)  # all or nothing
    for block_id in tails:
        # An entry vLLM registered inside a rolled-back block (a prompt's tail) may
        # cover wiped tokens: it goes; vLLM registers it again when they are recomputed.
        pool.tails.pop(block_id, None)
    pool.withdraw(scheduler._kvguard_ledger.roll_back(req_id))
    for manager in managers:
        # vLLM cached the full blocks past the boundary when it scheduled the lost
        # steps: it caches them again when the steps recomputing them are scheduled.
        first = boundary // manager.block_size
        cached = manager.num_cached_block
        if cached.get(req_id, 0) > first:
            cached[req_id] = first
    request.num_computed_tokens = boundary
    request.num_output_placeholders = 0
    request.spec_token_ids = []


from vllm.v1.request import RequestStatus  # noqa: E402

from kvguard.adapters.vllm.scheduler.startup import _GuardStartUp, logger  # noqa: E402


class _Recovery(_GuardStartUp):
    """The guarded scheduler's recovery: ``recover``, and vLLM's fault handler's abort
    turned into it."""

    @contextlib.contextmanager
    def kvguard_fault(self) -> Iterator[None]:
        """While vLLM's fault handler runs (the plugin wraps ``on_fault``): its abort of
        every request, ``finish_requests(None, FINISHED_ABORTED)``, recovers them
        instead, and returns only those that cannot resume."""
        self._kvguard_on_fault = True
        try:
            yield
        finally:
            self._kvguard_on_fault = False

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        if (
            self._kvguard_on_fault
            and request_ids is None
            and finished_status == RequestStatus.FINISHED_ABORTED
        ):
            self._kvguard_on_fault = False  # (recover() may finish requests itself)
            report = self.recover()
            if report.resumed:
                logger.warning(
                    "kvguard: engine fault: %d request(s) roll back to their validated "
                    "KV and resume after recovery (%d token(s) to recompute) instead of "
                    "being aborted",
                    len(report.resumed),
                    sum(r.rolled_back for r in report.resumed),
                )
            return [request for request, _ in report.ended]
        return super().finish_requests(request_ids, finished_status)

    def recover(self, request_ids: Iterable[str] | None = None) -> RecoveryReport:
        """Roll requests whose steps in flight are lost back to their validated KV, so
        that they resume instead of being aborted (see :mod:`.recovery`).

        ``request_ids``: the requests to roll back (default: every request with a step
        in flight). Call it when those steps' outputs will never be processed -- after
        a fault, before the next ``schedule()``. Each request resumes from the end of
        the tokens its clean steps computed; the token slots past it are wiped on the
        workers before the next step. A request that cannot resume is finished with
        ``FINISHED_ERROR`` (logged with the reason) and returned in ``ended``: its
        client must be told, as for an abort.
        """
        ledger = self._kvguard_ledger
        resumed: list[ResumedRequest] = []
        unresumable: dict[str, str] = {}
        for req_id in requests_to_recover(self, request_ids):
            request = self.requests[req_id]
            if request.is_finished():
                continue
            in_flight = ledger.tokens_in_flight(req_id)
            if not in_flight:
                continue
            boundary = request.num_computed_tokens - in_flight
            reason = why_not_resumable(self, request, boundary)
            if reason is None:
                try:
                    roll_back_request(self, request, boundary)
                except RollbackError as exc:
                    reason = f"its KV cannot be rolled back ({exc})"
            if reason is not None:
                unresumable[req_id] = reason
                continue
            resumed.append(ResumedRequest(req_id, boundary, in_flight))
        ended = []
        if unresumable:
            for request in self._kvguard_finish_failing(dict.fromkeys(unresumable, 0)):
                reason = unresumable[request.request_id]
                logger.warning(
                    "kvguard: request %s cannot resume after the fault (finish reason "
                    "'error'): %s; its KV past its last validated step is quarantined",
                    request.request_id,
                    reason,
                )
                ended.append((request, reason))
        # kvguard's pool queued the slots to wipe; they travel with the next step.
        slots = self.kvguard_pool.core.take_slots_to_zero()
        self._kvguard_slots += slots
        metrics = self.kvguard_metrics
        metrics.requests_recovered += len(resumed)
        metrics.tokens_rolled_back += sum(r.rolled_back for r in resumed)
        metrics.requests_unrecoverable += len(ended)
        return RecoveryReport(tuple(resumed), tuple(ended), tuple(slots))
