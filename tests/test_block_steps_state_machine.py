"""Stateful property test of the block-level API, the one the vLLM adapter drives.

Random sequences of allocate (plain or WRITTEN), write, validate (with or without held
publications), publish_block, fail, acquire (prefix hits) and release (with or without
``steps_passed``), on a pool with ``check_invariants=True``. An independent shadow
model tracks, per block, the steps writing it that have not validated and whether its
bytes are suspect, and checks:

* the prefix index only ever maps a hash to a block none of whose writes is pending
  or failed (a hit, an acquire, never reaches unvalidated KV);
* a block written by a failed or abandoned step is queued for zeroing before its next
  owner gets it;
* misuse raises a typed error and leaves the pool's snapshot unchanged.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvguard import BlockPool, BlockState, OutOfBlocksError, ZeroPolicy
from kvguard.hashing import BlockHash

from .helpers import ran_or_changed_nothing

NUM_BLOCKS = 10
HASHES = [BlockHash(bytes([i]) * 16) for i in range(6)]


class BlockLevelMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, 4, check_invariants=True, zero_policy=ZeroPolicy.SUSPECT)
        self.held: list[int] = []  # one entry per block-level reference this test holds
        self.pending: dict[int, int] = {}  # block -> in-flight steps writing it
        self.dirty: set[int] = set()  # written by a failed/abandoned step, not zeroed

    def _misuse(self, fn: Callable[..., object], *args: object, **kwargs: object) -> bool:
        """Call; on a typed error, assert the pool did not change. True if it ran."""
        return ran_or_changed_nothing(self.pool, fn, *args, **kwargs)

    def _drain_zero(self) -> None:
        for block_id in self.pool.take_blocks_to_zero():
            self.dirty.discard(block_id)

    def _handed_out(self, ids: list[int], *, write: bool) -> None:
        for block_id in ids:
            assert block_id not in self.dirty, f"block {block_id} reused before zeroing"
            self.held.append(block_id)
            if write:
                self.pending[block_id] = 1

    @rule(n=st.integers(0, 4), write=st.booleans())
    def allocate(self, n: int, write: bool) -> None:
        before = self.pool.snapshot()
        try:
            ids = self.pool.allocate_blocks(n, write=write)
        except OutOfBlocksError:
            assert self.pool.snapshot() == before
            return
        self._drain_zero()
        self._handed_out(ids, write=write)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(set(self.held))), max_size=3, unique=True))
        if self._misuse(self.pool.write_blocks, ids):
            for block_id in ids:
                self.pending[block_id] = self.pending.get(block_id, 0) + 1

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), hold_publications=st.booleans())
    def validate(self, data: st.DataObject, hold_publications: bool) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.pending) + [NUM_BLOCKS]), max_size=4))
        publish = None
        if hold_publications:
            publish = {
                block_id: (data.draw(st.sampled_from(HASHES)), None, "r") for block_id in ids
            }
        if self._misuse(self.pool.validate_blocks, ids, publish):
            for block_id in ids:
                self.pending[block_id] -= 1
                if not self.pending[block_id]:
                    del self.pending[block_id]

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def publish(self, data: st.DataObject) -> None:
        block_id = data.draw(st.sampled_from(self.held))
        block_hash = data.draw(st.sampled_from(HASHES))
        self._misuse(self.pool.publish_block, block_id, block_hash, None, owner="r")

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.pending)), max_size=3, unique=True))
        quarantined = self.pool.fail_blocks(ids)
        assert set(quarantined) == set(ids)
        for block_id in ids:
            del self.pending[block_id]
            self.dirty.add(block_id)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), steps_passed=st.booleans())
    def release(self, data: st.DataObject, steps_passed: bool) -> None:
        ids = data.draw(st.lists(st.sampled_from(self.held), min_size=1, max_size=3))
        if not self._misuse(self.pool.release_blocks, ids, steps_passed=steps_passed):
            return
        for block_id in ids:
            self.held.remove(block_id)
            if block_id not in self.held and block_id in self.pending:
                del self.pending[block_id]
                if steps_passed:  # its steps passed: validated, then released
                    assert self.pool.block_info(block_id).state is not BlockState.QUARANTINED
                else:  # abandoned mid-step: quarantined
                    self.dirty.add(block_id)

    @rule(block_hash=st.sampled_from(HASHES))
    def hit(self, block_hash: BlockHash) -> None:
        block_id = self.pool.cached_block_id(block_hash)
        if block_id is None:
            return
        self.pool.acquire_blocks([block_id])
        self.held.append(block_id)

    @invariant()
    def index_holds_only_validated_clean_blocks(self) -> None:
        for block_hash, block_id in self.pool.prefix_index.items():
            assert block_id not in self.pending, f"{block_id} indexed with a step in flight"
            assert block_id not in self.dirty, f"{block_id} indexed with suspect bytes"
            assert self.pool.block_info(block_id).state in (
                BlockState.PUBLISHED,
                BlockState.OFFLOADED,
            )
            assert self.pool.block_hash(block_id) == block_hash

    @invariant()
    def references_match(self) -> None:
        for block_id in set(self.held):
            assert self.pool.block_info(block_id).ref_cnt == self.held.count(block_id)


BlockLevelMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVGUARD_STATEFUL_EXAMPLES", "200")),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockLevelMachine = BlockLevelMachine.TestCase
