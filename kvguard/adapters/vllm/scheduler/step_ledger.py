"""The one record of the publications the guard holds back inside vLLM, and what each waits for.

vLLM caches a full block (``cache_full_blocks``) before the KV in it is known to be
good; the guarded pool notes the block and the publication it is due -- ``(hash,
parent, owner)`` -- here instead of publishing it. Every such publication is in exactly
one place of this ledger until it is published, quarantined or dropped:

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
  vouched for) -- or, with no scheduler, cached at all: whoever drives the pool takes
  them (:meth:`StepLedger.take_noted`);
* **carried** (:attr:`StepLedger.carried`): filled without a counted step of their
  request (KV a connector loaded, a step that came back without a NaN count, late
  fills): the request's next scheduled step takes them over.

With vLLM's KV events on, :attr:`StepLedger.events` keeps, per held block, what vLLM's
``BlockStored`` event is built from once the block is published.

A decode step writing one more token into a partial block needs no record at all: that
block is validated by the step that fills it, or as its request's blocks are released
after a clean step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvguard.block import PendingPublication
from kvguard.errors import ConsistencyError


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


@dataclass(slots=True, eq=False)
class HeldFills:
    """Blocks filled per request, and the publications held back for them."""

    fills: dict[str, list[int]] = field(default_factory=dict)
    publications: dict[int, PendingPublication] = field(default_factory=dict)

    def add(
        self, request_id: str, block_ids: list[int], publications: Mapping[int, PendingPublication]
    ) -> None:
        self.fills.setdefault(request_id, []).extend(block_ids)
        self.publications.update((b, publications[b]) for b in block_ids if b in publications)

    def drop(self, request_id: str, block_ids: set[int] | None = None) -> None:
        """Forget the request's blocks (those in ``block_ids``; all without it)."""
        held = self.fills.get(request_id)
        if held is None:
            return
        kept = [] if block_ids is None else [b for b in held if b not in block_ids]
        for block_id in held:
            if block_ids is None or block_id in block_ids:
                self.publications.pop(block_id, None)
        if kept:
            self.fills[request_id] = kept
        else:
            del self.fills[request_id]


BlockStoredArgs = tuple[Any, int, int, int]
"""What vLLM's ``BlockStored`` event for a held block is built from: (vLLM's request,
block index, block size, KV cache group)."""


class StepLedger:
    """Every publication held back (see the module docstring), written by the guarded
    pool (:meth:`note`, :attr:`events`) and driven by the guarded scheduler."""

    __slots__ = (
        "_steps",
        "carried",
        "events",
        "noted",
        "noting",
        "scheduling",
        "settled",
        "settled_publications",
        "settles",
    )

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
        self.settled_publications: dict[int, PendingPublication] = {}
        self.noted = HeldFills()
        self.noting = self.noted.publications
        """Where the pool puts the publications of the blocks it notes now: the step
        being scheduled's, else the noted ones'."""
        self.carried = HeldFills()
        self.events: dict[int, BlockStoredArgs] = {}

    def __len__(self) -> int:
        return len(self._steps)

    # ------------------------------------------------------------------ noting

    def note(self, request_id: str, block_ids: list[int], num_tokens: int) -> None:
        """vLLM cached ``block_ids`` of the request, covering its first ``num_tokens``
        tokens; their publications are in :attr:`noting` already."""
        step = self.scheduling
        if step is not None:
            step.fills.setdefault(request_id, []).extend(block_ids)
            return
        settles = self.settles
        if settles is not None and settles(request_id, num_tokens):
            noted = self.noted.publications
            settled = self.settled_publications
            self.settled += block_ids
            for block_id in block_ids:
                settled[block_id] = noted.pop(block_id)
        else:
            self.noted.fills.setdefault(request_id, []).extend(block_ids)

    def hold(
        self, request_id: str, block_id: int, publication: PendingPublication, num_tokens: int
    ) -> None:
        """Hold ``publication`` for ``block_id``, which the request fills now (noted as
        :meth:`note` does, once: a key withdrawn and replaced within the step leaves the
        block noted already)."""
        self.noting[block_id] = publication
        step = self.scheduling
        fills = (step.fills if step is not None else self.noted.fills).get(request_id, ())
        if block_id not in fills:
            self.note(request_id, [block_id], num_tokens)

    def take_settled(self) -> tuple[list[int], dict[int, PendingPublication]]:
        """The settled blocks, in the order they were noted, and their publications."""
        taken = self.settled, self.settled_publications
        self.settled, self.settled_publications = [], {}
        return taken

    def take_noted(self) -> HeldFills:
        noted = self.noted
        self.noted = HeldFills()
        if self.scheduling is None:
            self.noting = self.noted.publications
        return noted

    # ------------------------------------------------------------------ steps

    def open(self) -> None:
        """vLLM starts scheduling a step: the blocks it caches now are this step's.
        (Blocks noted outside a step and not taken since -- none expected -- are
        dropped.)"""
        if self.noted.fills or self.noted.publications:
            self.noted = HeldFills()
        self.scheduling = step = StepRecord(None, {})
        self.noting = step.publications

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
        self.noting = self.noted.publications
        record.token = token
        record.scheduled = scheduled
        carried = self.carried
        if carried.fills:
            held = carried.publications
            for req_id in [r for r in carried.fills if r in scheduled]:
                ids = carried.fills.pop(req_id)
                record.fills.setdefault(req_id, []).extend(ids)
                record.publications.update((b, held.pop(b)) for b in ids if b in held)
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
            for block_id in step.fills.pop(request_id):
                step.publications.pop(block_id, None)
            step.dropped.add(request_id)
        for record in self._steps:
            if request_id in record.scheduled or request_id in record.fills:
                record.fills.pop(request_id, None)
                record.dropped.add(request_id)

    def roll_back(self, request_id: str) -> None:
        """The request's steps in flight will never report back for it, but it stays
        (``recover``): each forgets it as for a freed request, and drops the
        publications and held events of the blocks it filled (they are rolled back;
        the request's next steps fill and note them again). What it carried stays its
        own to vouch for."""
        for record in self._steps:
            if request_id in record.scheduled or request_id in record.fills:
                for block_id in record.fills.pop(request_id, ()):
                    record.publications.pop(block_id, None)
                    self.events.pop(block_id, None)
                record.dropped.add(request_id)

    # ------------------------------------------------------------------ per block

    def _publication_maps(self) -> Iterator[dict[int, PendingPublication]]:
        if self.scheduling is not None:
            yield self.scheduling.publications
        for record in self._steps:
            yield record.publications
        yield self.noted.publications
        yield self.settled_publications
        yield self.carried.publications

    def publication_of(self, block_id: int) -> PendingPublication | None:
        """The publication held for ``block_id``, wherever it waits (None: none)."""
        for publications in self._publication_maps():
            held = publications.get(block_id)
            if held is not None:
                return held
        return None

    def withdraw(self, block_id: int) -> bool:
        """vLLM took the entry of ``block_id`` back before it was published (the
        block's content is being replaced): the publication held for it goes, wherever
        it waits. The block stays the fill of its step -- validated or quarantined with
        it, only never published. Whether one was held."""
        found = False
        for publications in self._publication_maps():
            if publications.pop(block_id, None) is not None:
                found = True
        self.events.pop(block_id, None)
        return found

    # ------------------------------------------------------------------ checks

    def held_blocks(self) -> Iterator[int]:
        """The blocks whose held publication or event is for a block still WRITTEN
        (checks, tests): noted, settled, the step being scheduled, and every block
        waiting for its vLLM event. (A step in flight may still hold the publication of
        a block its request released since: it is never validated -- the request was
        dropped -- and goes with the step.)"""
        if self.scheduling is not None:
            yield from self.scheduling.publications
        yield from self.settled_publications
        yield from self.noted.publications
        yield from self.events

    def is_empty(self) -> bool:
        """Nothing held: no step in flight, nothing noted, settled, carried or waiting
        for its event."""
        return not (
            self._steps
            or self.scheduling is not None
            or self.settled
            or self.noted.fills
            or self.carried.fills
            or self.events
        )
