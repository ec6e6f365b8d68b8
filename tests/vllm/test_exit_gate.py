"""The exit gate's validated frontier and its cleared-tokens record, on a real guarded
scheduler's pool: what an exit asks at every step, answered without walking blocks
while nothing can have moved a block back."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from kvguard.adapters.vllm.exits.gate import ExitGate, group_key

from .harness import BLOCK, make_request, make_scheduler, step

pytestmark = pytest.mark.vllm

PROMPT = list(range(100, 100 + 3 * BLOCK + 2))


def _running(max_num_batched_tokens: int = 4 * BLOCK) -> tuple[Any, Any, ExitGate]:
    """A guarded scheduler with request "a" (3 full blocks + 2 tokens) prefilled in one
    clean step, and a gate bound to its pool."""
    s = make_scheduler(max_num_batched_tokens=max_num_batched_tokens)
    s.add_request(make_request("a", PROMPT, max_tokens=8))
    step(s)
    gate = ExitGate("cpu", ())
    assert gate.bind(s.kv_cache_manager.block_pool) is not None
    return s, s.requests["a"], gate


def _table(s: Any, req_id: str) -> list[int]:
    (blocks,) = s.kv_cache_manager.get_block_ids(req_id)
    return list(blocks)


def test_the_frontier_counts_validated_blocks_under_the_requests_keys() -> None:
    s, a, gate = _running()
    table = _table(s, "a")
    assert gate.frontier("a", 0, table, a.block_hashes, BLOCK) == 3  # the partial 4th: no key
    assert gate.frontier("a", 0, table, a.block_hashes, BLOCK, start=2) == 3
    # Another request's hashes at those positions: nothing may leave as its keys.
    other = make_request("b", [7] * len(PROMPT))
    assert gate.frontier("b", 0, table, other.block_hashes, BLOCK) == 0
    pool = s.kv_cache_manager.block_pool
    key = group_key(a.block_hashes[0], 0)
    assert gate.storable(table[0], key) and not gate.storable(table[3], key)
    assert pool.core.tier_gate.storable_as(table[0], key)


def test_an_unbound_gate_lets_nothing_leave() -> None:
    s, a, _ = _running()
    gate = ExitGate("cpu", ())
    assert gate.frontier("a", 0, _table(s, "a"), a.block_hashes, BLOCK) == 0
    gate.note_cleared("a", 0, 3 * BLOCK)
    assert not gate.clears("a", 0, BLOCK)


def test_cleared_tokens_are_trusted_until_something_may_have_moved_them() -> None:
    s, a, gate = _running()
    gate.note_cleared("a", a.num_preemptions, 3 * BLOCK)
    assert gate.clears("a", a.num_preemptions, 3 * BLOCK)
    assert gate.clears("a", a.num_preemptions, BLOCK)
    assert not gate.clears("a", a.num_preemptions, 3 * BLOCK + 1)  # past what was cleared
    assert not gate.clears("b", 0, 0)  # never cleared
    assert not gate.clears("a", a.num_preemptions + 1, BLOCK)  # preempted since: table rebuilt
    # A quarantine anywhere in the pool (here: an invalidation) moves the exit epoch.
    pool = s.kv_cache_manager.block_pool
    pool.invalidate([group_key(a.block_hashes[2], 0)])
    assert not gate.clears("a", a.num_preemptions, BLOCK)


def test_an_eviction_leaves_what_a_running_request_cleared() -> None:
    # Only blocks nobody holds are evicted: a running request's cleared tokens stay.
    s = make_scheduler(num_blocks=8, max_num_batched_tokens=4 * BLOCK)
    s.add_request(make_request("a", PROMPT, max_tokens=8))
    s.add_request(make_request("old", [9] * (2 * BLOCK), max_tokens=1))
    step(s)
    step(s)  # "old" finishes: its two blocks stay cached, unheld
    assert "old" not in s.requests
    a = s.requests["a"]
    gate = ExitGate("cpu", ())
    gate.bind(s.kv_cache_manager.block_pool)
    table = _table(s, "a")
    n = gate.frontier("a", 0, table, a.block_hashes, BLOCK)
    assert n == 3
    gate.note_cleared("a", a.num_preemptions, n * BLOCK)
    evicted = s.kv_cache_manager.block_pool.core.counters().blocks_evicted
    s.add_request(make_request("new", [3] * (3 * BLOCK), max_tokens=1))
    step(s)  # takes the free blocks, evicting "old"'s cached ones
    assert s.kv_cache_manager.block_pool.core.counters().blocks_evicted > evicted
    assert gate.clears("a", a.num_preemptions, n * BLOCK)
    assert gate.frontier("a", 0, _table(s, "a"), a.block_hashes, BLOCK) >= n


def test_forgetting_a_request_drops_its_record() -> None:
    _, a, gate = _running()
    gate.note_cleared("a", a.num_preemptions, BLOCK)
    gate.forget_cleared("a")
    assert not gate.clears("a", a.num_preemptions, BLOCK)
    gate.note_cleared("a", a.num_preemptions, BLOCK)
    gate.forget_requests(keep=())
    assert not gate.clears("a", a.num_preemptions, BLOCK)
    assert gate.num_frontiers() == 0


def test_a_copy_stored_again_keeps_the_cores_record_of_its_blocks() -> None:
    """The tier stores a copy it holds again (the same name, the same blocks): the gate's
    record and the core's both still name its blocks, and both let them go once."""
    s, a, gate = _running()
    table = _table(s, "a")
    tier_gate = s.kv_cache_manager.block_pool.core.tier_gate
    key = group_key(a.block_hashes[0], 0)
    for _ in range(2):
        tickets = gate.open_all(table[:1])
        assert not isinstance(tickets, int)
        assert gate.settle("chunk", tickets)
        assert tier_gate.tier_copies(key) == ("cpu",)
        assert gate.recorded() == {"chunk": (key,)}
    assert gate.forget(["chunk"]) == 1
    assert tier_gate.tier_copies(key) == ()
