"""Which blocks each in-flight scheduler step wrote, per request, until its output arrives.

Outputs come back in the order steps were scheduled (sync and async scheduling alike),
so the ledger is a FIFO of steps; each step maps request id -> block ids it wrote. A
request that is freed or preempted is forgotten from every in-flight step: the output
that still arrives for it must validate nothing (its blocks were quarantined on release,
and may already belong to someone else).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class StepRecord:
    token: object
    """The SchedulerOutput this step was scheduled as (matched by identity)."""
    writes: dict[str, list[int]] = field(default_factory=dict)


class StepLedger:
    __slots__ = ("_steps",)

    def __init__(self) -> None:
        self._steps: deque[StepRecord] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    def open(self, token: object) -> StepRecord:
        record = StepRecord(token)
        self._steps.append(record)
        return record

    def close(self, token: object) -> StepRecord | None:
        """The oldest step, if ``token`` is it; None for a step that wrote nothing
        recorded (e.g. an output for a SchedulerOutput built elsewhere)."""
        if self._steps and self._steps[0].token is token:
            return self._steps.popleft()
        return None

    def later_writes(self, request_id: str) -> Iterator[int]:
        """Blocks the request's still-in-flight steps write, removing them (its abort)."""
        for record in self._steps:
            ids = record.writes.pop(request_id, None)
            if ids:
                yield from ids

    def forget(self, request_id: str) -> None:
        for record in self._steps:
            record.writes.pop(request_id, None)
