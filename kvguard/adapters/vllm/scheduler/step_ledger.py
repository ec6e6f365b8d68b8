"""The guarded scheduler's record of the blocks vLLM cached, and what each waits for.

vLLM caches a full block (``cache_full_blocks``) before the KV in it is known to be
good; the guarded pool holds back the publication it is due -- ``(hash, parent,
owner)``, the pool's own state -- and puts the block in its outbox
(:meth:`~kvguard.adapters.vllm.pool.block_pool.GuardedBlockPool.take_cached`). The
guarded scheduler takes the outbox at moments it controls (after vLLM scheduled a step,
before it releases a request's blocks, after an output is processed) and notes each
block here, the scheduler's alone. Every such block is in exactly one place of this
ledger until it is validated, quarantined or dropped:

* **the step being scheduled** (:attr:`StepLedger.scheduling`): vLLM caches the blocks a
  step fills while it schedules that step; they are that step's fills;
* **a step in flight** (a :class:`StepRecord`, oldest first): validated in one call when
  its output is clean, quarantined when the request's step fails. Outputs come back in
  the order steps were scheduled (sync and async scheduling alike), so the steps are a
  FIFO. A request freed or preempted is dropped from every step in flight (the output
  that still arrives for it validates nothing: its blocks were released, and may belong
  to someone else). A step whose output never arrives (vLLM's fault-tolerance drain) is
  dropped when a later step's output does (:meth:`StepLedger.skip_to`);
* **settled** (:attr:`StepLedger.settled`): cached while vLLM processes an output
  (under async scheduling, blocks whose last token just became known; with draft
  tokens, those accepted drafts filled), when every write into them reported clean
  (:attr:`StepLedger.settles`): validated together before any block is freed and when
  the output is processed;
* **noted** (:attr:`StepLedger.noted`): cached while an output is processed but not
  settled (the request's last step had no NaN count, or it holds loaded KV no step
  vouched for): the scheduler carries them (:meth:`StepLedger.take_noted`);
* **carried** (:attr:`StepLedger.carried`): filled without a counted step of their
  request (KV a connector loaded, a step that came back without a NaN count, late
  fills): the request's next scheduled step takes them over.

A decode step writing one more token into a partial block needs no record at all: that
block is validated by the step that fills it, or as its request's blocks are released
after a clean step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from kvguard.errors import ConsistencyError


@dataclass(slots=True, eq=False)
class StepRecord:
    token: object
    """The SchedulerOutput this step was scheduled as (matched by identity)."""
    scheduled: Mapping[str, int]
    """Request id -> tokens scheduled in this step (vLLM's dict, read-only here)."""
    fills: dict[str, list[int]] = field(default_factory=dict)
    """Request id -> block ids this step fills (validated when its output is clean)."""
    dropped: set[str] = field(default_factory=set)
    """Requests freed or preempted while this step was in flight."""


@dataclass(slots=True, eq=False)
class HeldFills:
    """Blocks filled per request, waiting for a step to vouch for them."""

    fills: dict[str, list[int]] = field(default_factory=dict)

    def add(self, request_id: str, block_ids: list[int]) -> None:
        self.fills.setdefault(request_id, []).extend(block_ids)

    def drop(self, request_id: str, block_ids: set[int] | None = None) -> None:
        """Forget the request's blocks (those in ``block_ids``; all without it)."""
        held = self.fills.get(request_id)
        if held is None:
            return
        kept = [] if block_ids is None else [b for b in held if b not in block_ids]
        if kept:
            self.fills[request_id] = kept
        else:
            del self.fills[request_id]


class StepLedger:
    """Every block vLLM cached that waits for a verdict (see the module docstring),
    written and read by the guarded scheduler alone."""

    __slots__ = ("_steps", "carried", "noted", "scheduling", "settled", "settles")

    def __init__(self, settles: Callable[[str, int], bool] | None = None) -> None:
        """``settles``: whether blocks covering a request's first tokens, cached
        outside a step's scheduling (while vLLM processes an output), were written by
        steps that all reported clean -- (request id, tokens) -> bool; the guarded
        scheduler's rule. None: never (they are noted)."""
        self._steps: deque[StepRecord] = deque()
        self.scheduling: StepRecord | None = None
        """The step vLLM is scheduling now (between :meth:`open` and :meth:`seal`)."""
        self.settles = settles
        self.settled: list[int] = []
        self.noted = HeldFills()
        self.carried = HeldFills()

    def __len__(self) -> int:
        return len(self._steps)

    # ------------------------------------------------------------------ noting

    def note(self, request_id: str, block_ids: list[int], num_tokens: int) -> None:
        """vLLM cached ``block_ids`` of the request, covering its first ``num_tokens``
        tokens (the pool holds their publications)."""
        step = self.scheduling
        if step is not None:
            step.fills.setdefault(request_id, []).extend(block_ids)
            return
        settles = self.settles
        if settles is not None and settles(request_id, num_tokens):
            self.settled += block_ids
        else:
            self.noted.fills.setdefault(request_id, []).extend(block_ids)

    def note_cached(self, cached: Iterable[tuple[str, list[int], int, bool]]) -> None:
        """:meth:`note` (or, for a one-block entry, :meth:`hold`) what the pool's outbox
        held, in order: (request id, block ids, tokens, once) each. While a step is
        being scheduled -- the common case -- the blocks' lists become the step's own."""
        step = self.scheduling
        if step is None:
            for request_id, block_ids, num_tokens, once in cached:
                if once:
                    self.hold(request_id, block_ids[0], num_tokens)
                else:
                    self.note(request_id, block_ids, num_tokens)
            return
        fills = step.fills
        for request_id, block_ids, num_tokens, once in cached:
            if once:
                self.hold(request_id, block_ids[0], num_tokens)
                continue
            held = fills.get(request_id)
            if held is None:
                fills[request_id] = block_ids
            else:
                held += block_ids

    def hold(self, request_id: str, block_id: int, num_tokens: int) -> None:
        """:meth:`note` for one block vLLM registered an entry for, once: a key
        withdrawn and replaced within the step leaves the block noted already."""
        step = self.scheduling
        fills = (step.fills if step is not None else self.noted.fills).get(request_id, ())
        if block_id not in fills:
            self.note(request_id, [block_id], num_tokens)

    def take_settled(self) -> list[int]:
        """The settled blocks, in the order they were noted."""
        taken = self.settled
        self.settled = []
        return taken

    def take_noted(self) -> HeldFills:
        noted = self.noted
        self.noted = HeldFills()
        return noted

    # ------------------------------------------------------------------ steps

    def open(self) -> None:
        """vLLM starts scheduling a step: the blocks it caches now are this step's.
        (Blocks noted outside a step and not taken since -- none expected -- are
        dropped.)"""
        if self.noted.fills:
            self.noted = HeldFills()
        self.scheduling = StepRecord(None, {})

    def seal(self, token: object, scheduled: Mapping[str, int]) -> StepRecord:
        """The step is scheduled (``token``: its SchedulerOutput): it goes in flight,
        taking over the carried fills of the requests it schedules."""
        record = self.scheduling
        if record is None:
            raise ConsistencyError(
                "StepLedger.seal() without open(): the guarded scheduler sealed a step it "
                "never opened"
            )
        self.scheduling = None
        record.token = token
        record.scheduled = scheduled
        carried = self.carried
        if carried.fills:
            for req_id in [r for r in carried.fills if r in scheduled]:
                record.fills.setdefault(req_id, []).extend(carried.fills.pop(req_id))
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

    # ------------------------------------------------------------------ per request

    def in_flight(self, request_id: str) -> bool:
        """Whether a step scheduled with the request has not reported back yet."""
        # A plain loop, not any(<generator>): called for every finished request.
        for record in self._steps:  # noqa: SIM110
            if request_id in record.scheduled:
                return True
        return False

    def requests_in_flight(self) -> list[str]:
        """Every request a step still in flight computes for (in step order, once)."""
        seen: dict[str, None] = {}
        for record in self._steps:
            dropped = record.dropped
            for req_id in record.scheduled:
                if req_id not in dropped:
                    seen[req_id] = None
        return list(seen)

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

    def filled_in_flight(self, request_id: str, block_ids: Iterable[int]) -> set[int]:
        """Those of ``block_ids`` that the request's still-in-flight steps fill (a
        window free asks this of every release: most find none)."""
        found: set[int] = set()
        for record in self._steps:
            filled = record.fills.get(request_id)
            if filled:
                found.update(filled)
        if found:
            found.intersection_update(block_ids)
        return found

    def take_fills(self, request_id: str, block_ids: set[int]) -> list[int]:
        """Take ``block_ids`` out of the request's in-flight fills: those found. (A
        sliding window or local chunk can free a block whose every write reported,
        while the step that cached it -- the next one, under async scheduling -- is
        still in flight.)"""
        taken: list[int] = []
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
            if not kept:
                del record.fills[request_id]
            elif len(kept) != len(filled):
                record.fills[request_id] = kept
        return taken

    def later_fills(self, request_id: str) -> Iterator[int]:
        """Blocks the request's still-in-flight steps fill, removing them (its abort)."""
        for record in self._steps:
            ids = record.fills.pop(request_id, None)
            if ids:
                yield from ids

    def forget(self, request_id: str) -> None:
        """The request leaves (finished or preempted): no step in flight validates
        anything for it, and what it carried is no longer its to vouch for."""
        if self.carried.fills:
            self.carried.drop(request_id)
        step = self.scheduling
        if step is not None and request_id in step.fills:
            # Preempted while this very step is scheduled (vLLM's priority policy takes
            # a request it already scheduled back out): its blocks are released now and
            # may be reused within the step, so what it filled is never its to publish
            # -- not by this step, nor carried to a later one.
            del step.fills[request_id]
            step.dropped.add(request_id)
        for record in self._steps:
            if request_id in record.scheduled or request_id in record.fills:
                record.fills.pop(request_id, None)
                record.dropped.add(request_id)

    def roll_back(self, request_id: str) -> list[int]:
        """The request's steps in flight will never report back for it, but it stays
        (``recover``): each forgets it as for a freed request. Returns the blocks they
        filled, whose held publications the caller withdraws (they are rolled back;
        the request's next steps fill and note them again). What it carried stays its
        own to vouch for."""
        dropped: list[int] = []
        for record in self._steps:
            if request_id in record.scheduled or request_id in record.fills:
                dropped += record.fills.pop(request_id, ())
                record.dropped.add(request_id)
        return dropped

    # ------------------------------------------------------------------ checks

    def is_empty(self) -> bool:
        """Nothing recorded: no step in flight, nothing noted, settled or carried."""
        return not (
            self._steps
            or self.scheduling is not None
            or self.settled
            or self.noted.fills
            or self.carried.fills
        )
