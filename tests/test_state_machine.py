"""Stateful property test: random sequences of every public pool operation.

After each step the pool's own ``check_invariants()`` runs (the pool is built with
``check_invariants=True``), and an independent shadow model of the *bytes* checks the
safety properties docs/design.md promises:

* a prefix lookup only returns blocks none of whose writes is unvalidated or failed;
* a block whose bytes are suspect is queued for zeroing before its next owner gets it;
* only blocks with validated bytes may be stored to a tier;
* misuse raises a typed error and leaves the pool's snapshot unchanged.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvguard import (
    BlockPool,
    BlockState,
    KvGuardError,
    OutOfBlocksError,
    PoolMisuseError,
    StepOutcome,
    StoreTicket,
    ZeroPolicy,
)

from .helpers import ran_or_changed_nothing

BLOCK = 4
PREFIXES = [list(range(100, 112)), list(range(200, 208)), list(range(100, 104)) + [7, 7]]
REQUEST_IDS = [f"r{i}" for i in range(6)]
MATCHABLE = {BlockState.PUBLISHED, BlockState.OFFLOADED}


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(12, BLOCK, check_invariants=True, zero_policy=ZeroPolicy.SUSPECT)
        # Shadow model of the bytes: per block, writes not validated yet, and "dirty"
        # (written by a failed/abandoned step, not wiped since).
        self.unvalidated: dict[int, set[tuple[str, int]]] = defaultdict(set)
        self.dirty: set[int] = set()
        self.tickets: list[StoreTicket] = []
        self.external: list[int] = []
        self.seq = 0

    # ---------------------------------------------------------------- helpers

    def _misuse(self, fn: Callable[..., object], *args: object, **kwargs: object) -> bool:
        """Call; on a typed error, assert the pool did not change. True if it ran."""
        return ran_or_changed_nothing(self.pool, fn, *args, **kwargs)

    def _drain_zero(self) -> None:
        for block_id in self.pool.take_blocks_to_zero():
            self.dirty.discard(block_id)
        for slot in self.pool.take_slots_to_zero():
            self.dirty.discard(slot.block_id)

    def _written(self, rid: str, start: int, end: int) -> None:
        """A step of ``rid`` writes tokens [start, end): its blocks hold unvalidated bytes."""
        table = self.pool.block_table(rid)
        for i in range(start // BLOCK, (end - 1) // BLOCK + 1):
            self.unvalidated[table[i]].add((rid, end))

    def _validated(self, rid: str, end: int) -> None:
        """Every step of ``rid`` ending at or before ``end`` passed."""
        for writes in self.unvalidated.values():
            writes -= {w for w in writes if w[0] == rid and w[1] <= end}

    def _abandon(self, rid: str) -> None:
        """Writes of ``rid`` that can no longer be validated leave dirty bytes."""
        for block_id, writes in self.unvalidated.items():
            mine = {w for w in writes if w[0] == rid}
            if mine:
                writes -= mine
                self.dirty.add(block_id)

    # ---------------------------------------------------------------- rules

    @rule(rid=st.sampled_from(REQUEST_IDS), prefix=st.integers(0, 2), extra=st.integers(0, 9))
    def add_and_allocate(self, rid: str, prefix: int, extra: int) -> None:
        tokens = PREFIXES[prefix] + [self.seq % 50 + 1000 + i for i in range(extra)]
        self.seq += 1
        if not self._misuse(self.pool.add_request, rid, tokens):
            return
        hit = self.pool.lookup(rid, max_tokens=len(tokens) - 1)
        for block_id in hit.block_ids:
            assert self.pool.block_info(block_id).state in MATCHABLE
            assert not self.unvalidated[block_id], f"hit on unvalidated block {block_id}"
            assert block_id not in self.dirty, f"hit on dirty block {block_id}"
        quarantined_free = set(self.pool.snapshot().free_queue[0])
        if self._misuse(self.pool.allocate, rid, len(tokens), hit=hit):
            new = set(self.pool.block_table(rid)[hit.num_blocks :])
            queued = set(self.pool.snapshot().zero_blocks)
            assert new & quarantined_free <= queued
            assert new & self.dirty <= queued, "suspect block handed out without zeroing"
        # Wipe before the step runs, as an engine does.
        self._drain_zero()

    def _open(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(self.pool.request_ids)))

    @precondition(lambda self: self.pool.request_ids)
    @rule(data=st.data(), n=st.integers(1, 9))
    def write(self, data: st.DataObject, n: int) -> None:
        rid = self._open(data)
        pool = self.pool
        if rid in pool.request_ids and not pool.progress(rid).aborted:
            written = pool.progress(rid).num_written_tokens
            self._misuse(pool.allocate, rid, written + n)
            self._drain_zero()
        before = pool.snapshot()
        try:
            tokens = pool.write(rid, n)
        except PoolMisuseError:
            assert pool.snapshot() == before
            return
        self._written(rid, tokens.start, tokens.end)

    @precondition(lambda self: self.pool.request_ids)
    @rule(data=st.data(), ok=st.booleans())
    def finish_step(self, data: st.DataObject, ok: bool) -> None:
        rid = self._open(data)
        pool = self.pool
        before = pool.snapshot()
        try:
            result = pool.validate_step(rid) if ok else pool.fail_step(rid)
        except PoolMisuseError:
            assert pool.snapshot() == before
            return
        if result.outcome is StepOutcome.VALIDATED:
            self._validated(rid, result.tokens.end)
            for block_id in result.published:
                assert not self.unvalidated[block_id]
        elif result.outcome is StepOutcome.FAILED:
            self._abandon(rid)
            for block_id in result.quarantined:
                assert pool.block_info(block_id).state is BlockState.QUARANTINED

    @precondition(lambda self: self.pool.request_ids)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 3), max_size=5))
    def append_tokens(self, data: st.DataObject, tokens: list[int]) -> None:
        self._misuse(self.pool.append_tokens, self._open(data), tokens)

    @precondition(lambda self: self.pool.request_ids)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = self._open(data)
        self.pool.free(rid)
        self._abandon(rid)

    @rule(rid=st.sampled_from(REQUEST_IDS), n=st.integers(-1, 3))
    def misuse_any_request(self, rid: str, n: int) -> None:
        """Operations on ids that may be unknown, with counts that may be bad."""
        pool = self.pool
        for fn, args in (
            (pool.write, (rid, n)),
            (pool.validate_step, (rid,)),
            (pool.fail_step, (rid,)),
            (pool.allocate, (rid, n)),
            (pool.lookup, (rid,)),
        ):
            before = pool.snapshot()
            try:
                fn(*args)
            except (PoolMisuseError, OutOfBlocksError):
                assert pool.snapshot() == before
                continue
            # It ran: it must have been a legal call on an open request; undo nothing,
            # but keep the shadow model honest about what was written.
            if fn == pool.write:
                end = pool.progress(rid).num_written_tokens
                self._written(rid, end - n, end)
            elif fn == pool.validate_step:
                self._validated(rid, pool.progress(rid).num_validated_tokens)
            elif fn == pool.fail_step:
                self._abandon(rid)

    @precondition(lambda self: self.pool.request_ids)
    @rule(data=st.data(), n=st.none() | st.integers(0, 12))
    def zero_request_tail(self, data: st.DataObject, n: int | None) -> None:
        rid = self._open(data)
        pool = self.pool
        before = pool.snapshot()
        try:
            rollback = pool.zero_request_tail(rid, n)
        except PoolMisuseError:
            assert pool.snapshot() == before
            return
        boundary = rollback.num_tokens
        progress = pool.progress(rid)
        assert progress.num_written_tokens == boundary
        truncated_step = boundary > progress.num_validated_tokens
        for i, block_id in enumerate(pool.block_table(rid)):
            writes = self.unvalidated[block_id]
            cut = {w for w in writes if w[0] == rid and w[1] > boundary}
            writes -= cut
            if cut and truncated_step and i * BLOCK < boundary:
                # The step straddling the boundary is truncated, still pending.
                writes.add((rid, boundary))
        for slot in rollback.slots:
            self.dirty.add(slot.block_id)  # garbled until the wipe below
        self._drain_zero()

    @rule(n=st.integers(0, 3))
    def allocate_blocks(self, n: int) -> None:
        before = self.pool.snapshot()
        try:
            self.external += self.pool.allocate_blocks(n)
        except OutOfBlocksError:
            assert self.pool.snapshot() == before
        self._drain_zero()

    @precondition(lambda self: self.external)
    @rule(data=st.data())
    def release_blocks(self, data: st.DataObject) -> None:
        block_id = data.draw(st.sampled_from(self.external))
        self.external.remove(block_id)
        self.pool.release_blocks([block_id])

    @rule(block_id=st.integers(-1, 12))
    def acquire_and_release(self, block_id: int) -> None:
        if self._misuse(self.pool.acquire_blocks, [block_id]):
            assert self.pool.block_info(block_id).state in MATCHABLE
            self.pool.release_blocks([block_id])

    @rule(data=st.data(), tier=st.sampled_from(["cpu", "disk"]))
    def begin_store(self, data: st.DataObject, tier: str) -> None:
        storable = sorted(
            {b for rid in self.pool.request_ids for b in self.pool.storable_blocks(rid, tier)}
        )
        block_id = data.draw(st.sampled_from([*storable, -1, 0, 5, 12]))
        before = self.pool.snapshot()
        try:
            ticket = self.pool.begin_store(block_id, tier)
        except PoolMisuseError:
            assert self.pool.snapshot() == before
            return
        assert not self.unvalidated[block_id] and block_id not in self.dirty
        self.tickets.append(ticket)

    @precondition(lambda self: self.tickets)
    @rule(data=st.data(), ok=st.booleans())
    def finish_store(self, data: st.DataObject, ok: bool) -> None:
        ticket = data.draw(st.sampled_from(self.tickets))
        self.tickets.remove(ticket)
        if ok:
            if self.pool.ack_store(ticket):
                assert not self.unvalidated[ticket.block_id]
                assert ticket.block_id not in self.dirty
        else:
            self.pool.fail_store(ticket)
        # Acknowledging twice is misuse.
        self._misuse(self.pool.ack_store, ticket)

    @rule(data=st.data())
    def invalidate(self, data: st.DataObject) -> None:
        published = [h for h, _ in self.pool.snapshot().index]
        if not published:
            return
        target = data.draw(st.sampled_from(published))
        report = self.pool.invalidate([target])
        assert target in report.hashes
        for block_id in report.block_ids:
            self.dirty.add(block_id)  # corrupt bytes found after the fact

    @rule(dice=st.integers(0, 9))
    def reset_prefix_cache(self, dice: int) -> None:
        if dice:  # rarely: a reset wipes out the cache the other rules build up
            return
        before = self.pool.snapshot()
        if not self.pool.reset_prefix_cache():
            assert self.pool.snapshot() == before

    @rule()
    def drain(self) -> None:
        self._drain_zero()
        self.pool.take_events()

    # ---------------------------------------------------------------- invariants

    @invariant()
    def matchable_blocks_hold_validated_bytes(self) -> None:
        for block_hash, block_id in self.pool.snapshot().index:
            assert not self.unvalidated[block_id], f"published block {block_id} unvalidated"
            assert block_id not in self.dirty, f"published block {block_id} is dirty"
            assert block_hash

    @invariant()
    def stats_add_up(self) -> None:
        stats = self.pool.stats()
        assert sum(stats.blocks_by_state.values()) == stats.num_blocks
        assert stats.num_free <= stats.num_blocks


PoolMachine.TestCase.settings = settings(
    # KVGUARD_STATEFUL_EXAMPLES=5000 for a long hunt; CI runs the default.
    max_examples=int(os.environ.get("KVGUARD_STATEFUL_EXAMPLES", "200")),
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolMachine = PoolMachine.TestCase


def test_kvguard_error_base() -> None:
    assert issubclass(PoolMisuseError, KvGuardError)
