"""Publication after validation only: the schedule-time race, aborts and preemption
mid-step, the zero queue, and identical decisions to stock vLLM on a clean trace."""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus  # noqa: E402

from kvguard import BlockState  # noqa: E402

from .harness import (  # noqa: E402
    BLOCK,
    decision_trace,
    hit_tokens,
    make_request,
    make_scheduler,
    model_output,
    shared_prefix_arrivals,
)

PROMPT = list(range(2000, 2000 + 3 * BLOCK + 5))


def test_stock_vllm_has_the_race_and_the_guard_closes_it_sync() -> None:
    stock = make_scheduler(guarded=False)
    guarded = make_scheduler()
    for s in (stock, guarded):
        s.add_request(make_request("a", PROMPT))
        s.add_request(make_request("b", PROMPT))  # admitted in the same schedule() call
    assert hit_tokens(stock.schedule())["b"] == 3 * BLOCK  # unwritten KV, shared
    so = guarded.schedule()
    assert hit_tokens(so)["b"] == 0
    guarded.update_from_output(so, model_output(guarded, so))
    # Once a's step validated, a newcomer hits it.
    guarded.add_request(make_request("c", PROMPT))
    assert hit_tokens(guarded.schedule())["c"] == 3 * BLOCK


def test_async_request_admitted_next_step_does_not_hit_unvalidated_blocks() -> None:
    s = make_scheduler(async_scheduling=True)
    s.add_request(make_request("a", PROMPT))
    so1 = s.schedule()
    s.add_request(make_request("b", PROMPT))
    so2 = s.schedule()  # step 1's output has not arrived yet
    assert hit_tokens(so2)["b"] == 0
    s.update_from_output(so1, model_output(s, so1, {"a": 1}))  # a's prefill was NaN
    s.update_from_output(so2, model_output(s, so2))
    s.add_request(make_request("c", PROMPT))
    so3 = s.schedule()
    # a's blocks never became hits; b's validated copy did.
    assert hit_tokens(so3)["c"] == 3 * BLOCK
    (c_table,) = s.kv_cache_manager.get_block_ids("c")
    (b_table,) = s.kv_cache_manager.get_block_ids("b")
    assert c_table[:3] == b_table[:3]
    s.kvguard_pool.check_consistency()


def test_client_abort_mid_step_quarantines_and_zeroes_on_reuse() -> None:
    s = make_scheduler(async_scheduling=True, num_blocks=6)
    s.add_request(make_request("a", PROMPT))
    so1 = s.schedule()
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)  # client went away
    core = s.kvguard_pool.core
    assert core.stats().blocks_by_state[BlockState.QUARANTINED] == 4
    s.update_from_output(so1, model_output(s, so1))  # the late output validates nothing
    assert core.stats().blocks_by_state[BlockState.PUBLISHED] == 0
    s.add_request(make_request("b", PROMPT))
    so2 = s.schedule()
    assert hit_tokens(so2)["b"] == 0
    (table,) = s.kv_cache_manager.get_block_ids("b")
    assert sorted(so2.new_block_ids_to_zero or []) == sorted(table)
    s.kvguard_pool.check_consistency()


def test_preemption_mid_step_quarantines_only_the_unchecked_blocks() -> None:
    # 4 usable blocks: both prompts fit (2 blocks each), the first decode does not.
    s = make_scheduler(async_scheduling=True, num_blocks=5)
    s.add_request(make_request("a", list(range(100, 100 + 2 * BLOCK)), max_tokens=8))
    s.add_request(make_request("b", list(range(300, 300 + 2 * BLOCK)), max_tokens=8))
    so1 = s.schedule()
    assert so1.num_scheduled_tokens == {"a": 2 * BLOCK, "b": 2 * BLOCK}
    (b_table,) = s.kv_cache_manager.get_block_ids("b")
    so2 = s.schedule()  # decode needs a third block: b is preempted, its prefill unchecked
    assert "b" in so2.preempted_req_ids
    core = s.kvguard_pool.core
    assert core.stats().counters.blocks_quarantined == 2
    # a's new block is one of b's quarantined blocks: it is zeroed before a writes it.
    (a_table,) = s.kv_cache_manager.get_block_ids("a")
    assert so2.new_block_ids_to_zero == [a_table[-1]] and a_table[-1] in b_table
    s.update_from_output(so1, model_output(s, so1))
    s.update_from_output(so2, model_output(s, so2))
    states = [core.block_state(b) for b in s.kv_cache_manager.get_block_ids("a")[0]]
    assert BlockState.QUARANTINED not in states
    s.kvguard_pool.check_consistency()


def test_zeroed_blocks_never_hold_validated_kv() -> None:
    rng = random.Random(7)
    s = make_scheduler(num_blocks=24, max_num_batched_tokens=48)
    core = s.kvguard_pool.core
    prefixes = [list(range(k * 1000, k * 1000 + 2 * BLOCK)) for k in range(3)]
    zeroed_total = 0
    for i in range(40):
        if i % 2 == 0:
            prompt = rng.choice(prefixes) + [
                rng.randrange(50_000) for _ in range(rng.randrange(1, 20))
            ]
            s.add_request(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 6)))
        so = s.schedule()
        for block_id in so.new_block_ids_to_zero or []:
            # Handed out this step after quarantine: nobody's validated KV lives there.
            assert core.block_state(block_id) in (BlockState.ALLOCATED, BlockState.WRITTEN)
            zeroed_total += 1
        nans = {r: 1 for r in so.num_scheduled_tokens if rng.random() < 0.1}
        s.update_from_output(so, model_output(s, so, nans))
        s.kvguard_pool.check_consistency()
    assert zeroed_total > 0
    assert s.kvguard_stats()["blocks_zeroed"] == zeroed_total


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_clean_trace_same_decisions_as_stock_vllm(async_scheduling: bool) -> None:
    """No NaN and no shared prefix admitted while its sharer is unchecked: the guarded
    scheduler decides exactly what stock vLLM decides."""
    arrivals = shared_prefix_arrivals(3, 12, 3 * BLOCK, (1, 6))
    runs: list[list[object]] = []
    for guarded in (False, True):
        s = make_scheduler(guarded=guarded, async_scheduling=async_scheduling, num_blocks=40)
        trace = decision_trace(s, arrivals, 80, async_scheduling=async_scheduling)
        runs.append(trace)
    assert runs[0] == runs[1]
    assert any(h for entry in runs[0] if isinstance(entry, tuple) for h in entry[2].values())
