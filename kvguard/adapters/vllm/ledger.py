"""Which blocks each in-flight scheduler step fills, per request, until its output arrives.

Outputs come back in the order steps were scheduled (sync and async scheduling alike),
so the ledger is a FIFO of steps. A step's record holds the requests it scheduled (the
SchedulerOutput's own ``num_scheduled_tokens`` dict, not copied) and the blocks it
*filled* per request: the full blocks vLLM caches while scheduling it. A block is
validated by the step that fills it; a decode step writing into a partial block needs no
bookkeeping at all (that block is validated by the step that fills it, or when its
request ends cleanly). A request that is freed or preempted is dropped from every
in-flight step: the output that still arrives for it must validate nothing (its blocks
were quarantined on release, and may already belong to someone else). A step whose
output never arrives (vLLM's fault-tolerance drain) is dropped when a later step's
output does (:meth:`StepLedger.skip_to`), so the ledger holds the steps in flight only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from kvguard.block import PendingPublication


@dataclass(slots=True, eq=False)
class StepRecord:
    token: object
    """The SchedulerOutput this step was scheduled as (matched by identity)."""
    scheduled: Mapping[str, int]
    """Request id -> tokens scheduled in this step (vLLM's dict, read-only here)."""
    fills: dict[str, list[int]] = field(default_factory=dict)
    """Request id -> block ids this step fills (validated when its output is clean)."""
    publications: dict[int, PendingPublication] = field(default_factory=dict)
    """Block id -> the publication held back for it until this step's output."""
    dropped: set[str] = field(default_factory=set)
    """Requests freed or preempted while this step was in flight."""


class StepLedger:
    __slots__ = ("_steps",)

    def __init__(self) -> None:
        self._steps: deque[StepRecord] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    def open(
        self,
        token: object,
        scheduled: Mapping[str, int],
        fills: dict[str, list[int]],
        publications: dict[int, PendingPublication],
    ) -> StepRecord:
        record = StepRecord(token, scheduled, fills, publications)
        self._steps.append(record)
        return record

    def close(self, token: object) -> StepRecord | None:
        """The oldest step, if ``token`` is it; None for a step that wrote nothing
        recorded (e.g. an output for a SchedulerOutput built elsewhere)."""
        if self._steps and self._steps[0].token is token:
            return self._steps.popleft()
        return None

    def skip_to(self, token: object) -> list[StepRecord]:
        """The steps scheduled before ``token``'s, removed: their outputs never come
        (vLLM's fault tolerance aborts every request and drops the outputs of the
        steps in flight), since outputs arrive in step order. Nothing when ``token``
        is not in the ledger."""
        steps = self._steps
        if not any(record.token is token for record in steps):
            return []
        lost = []
        while steps[0].token is not token:
            lost.append(steps.popleft())
        return lost

    def in_flight(self, request_id: str) -> bool:
        """Whether a step scheduled with the request has not reported back yet."""
        # A plain loop, not any(<generator>): called for every finished request.
        for record in self._steps:  # noqa: SIM110
            if request_id in record.scheduled:
                return True
        return False

    def tokens_in_flight(self, request_id: str) -> int:
        """Tokens of the request that steps still in flight compute (for it as it is
        now: steps scheduled before it was preempted or freed do not count)."""
        return sum(
            record.scheduled.get(request_id, 0)
            for record in self._steps
            if request_id not in record.dropped
        )

    def fills_in_flight(self, request_id: str) -> Iterator[int]:
        """Blocks the request's still-in-flight steps fill (read-only)."""
        for record in self._steps:
            yield from record.fills.get(request_id, ())

    def take_fills(
        self, request_id: str, block_ids: set[int]
    ) -> tuple[list[int], dict[int, PendingPublication]]:
        """Take ``block_ids`` out of the request's in-flight fills: those found, and
        the publications their steps held for them. (A sliding window or local chunk
        can free a block whose every write reported, while the step that cached it --
        the next one, under async scheduling -- is still in flight.)"""
        taken: list[int] = []
        publications: dict[int, PendingPublication] = {}
        for record in self._steps:
            filled = record.fills.get(request_id)
            if not filled:
                continue
            kept = []
            for block_id in filled:
                if block_id not in block_ids:
                    kept.append(block_id)
                    continue
                taken.append(block_id)
                held = record.publications.pop(block_id, None)
                if held is not None:
                    publications[block_id] = held
            if not kept:
                del record.fills[request_id]
            elif len(kept) != len(filled):
                record.fills[request_id] = kept
        return taken, publications

    def later_fills(self, request_id: str) -> Iterator[int]:
        """Blocks the request's still-in-flight steps fill, removing them (its abort)."""
        for record in self._steps:
            ids = record.fills.pop(request_id, None)
            if ids:
                yield from ids

    def forget(self, request_id: str) -> None:
        for record in self._steps:
            if request_id in record.scheduled or request_id in record.fills:
                record.fills.pop(request_id, None)
                record.dropped.add(request_id)
