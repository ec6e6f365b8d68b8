"""The guard's per-step cost model: blocks are WRITTEN from allocation until the step
that fills them validates; decode steps into a partial block cost nothing; a clean
finish validates the partial tail (no quarantine, no zeroing)."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from kvguard import BlockState  # noqa: E402

from .harness import (  # noqa: E402
    BLOCK,
    finish_reasons,
    make_request,
    make_scheduler,
    model_output,
    step,
)


def _states(s: Any, req_id: str) -> list[BlockState]:
    core = s.kvguard_pool.core
    (ids,) = s.kv_cache_manager.get_block_ids(req_id)
    return [core.block_state(b) for b in ids]


def test_decode_steps_leave_the_partial_block_written_until_it_fills() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", list(range(100, 100 + BLOCK + 3)), max_tokens=40))
    step(s)  # prefill: one full block (validated, published) and a partial one
    assert _states(s, "a") == [BlockState.PUBLISHED, BlockState.WRITTEN]
    core = s.kvguard_pool.core
    before = core.stats().counters
    for _ in range(BLOCK - 4):  # decode, the partial block not yet full
        step(s)
        assert _states(s, "a") == [BlockState.PUBLISHED, BlockState.WRITTEN]
    assert core.stats().counters == before, "a decode step changed kvguard's pool"
    step(s)  # this step fills block 1 ...
    step(s)  # ... whose validation published it; block 2 is the new tail
    assert _states(s, "a")[:2] == [BlockState.PUBLISHED, BlockState.PUBLISHED]
    assert _states(s, "a")[2] is BlockState.WRITTEN
    s.kvguard_pool.check_consistency()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_clean_finish_frees_the_tail_without_quarantine(async_scheduling: bool) -> None:
    s = make_scheduler(async_scheduling=async_scheduling)
    s.add_request(make_request("a", list(range(100, 100 + BLOCK + 3)), max_tokens=3))
    reasons: dict[str, str] = {}
    pending = []
    while "a" not in reasons:
        pending.append(s.schedule())
        if not async_scheduling or len(pending) == 2:
            so = pending.pop(0)
            reasons.update(finish_reasons(s.update_from_output(so, model_output(s, so))))
    for so in pending:
        s.update_from_output(so, model_output(s, so))
    core = s.kvguard_pool.core
    quarantined = core.stats().counters.blocks_quarantined
    # The last step was clean and none of a's steps is in flight (vLLM's async
    # scheduler schedules no step past max_tokens), so the tail is freed as validated.
    assert quarantined == 0
    assert core.stats().blocks_by_state[BlockState.PUBLISHED] == 1
    s.kvguard_pool.check_consistency()


def test_preemption_after_a_clean_step_frees_the_tail_without_quarantine() -> None:
    # 4 usable blocks: a (30 tokens) and b (20 tokens) take 2 each; a's decode soon
    # needs a third, and b -- no step of it in flight (sync) -- is preempted.
    s = make_scheduler(num_blocks=5)
    s.add_request(make_request("a", list(range(100, 100 + 2 * BLOCK - 2)), max_tokens=8))
    s.add_request(make_request("b", list(range(300, 300 + BLOCK + 4)), max_tokens=8))
    core = s.kvguard_pool.core
    b_tail = None
    for _ in range(4):
        so = s.schedule()
        if "b" in so.preempted_req_ids:
            break
        (b_table,) = s.kv_cache_manager.get_block_ids("b")
        b_tail = b_table[-1]
        s.update_from_output(so, model_output(s, so))
    else:
        raise AssertionError("b was never preempted")
    assert b_tail is not None and core.block_state(b_tail) is not BlockState.QUARANTINED
    assert core.stats().counters.blocks_quarantined == 0
    assert not so.new_block_ids_to_zero  # nothing suspect was handed to a
    s.kvguard_pool.check_consistency()


def test_a_connector_holding_a_clean_request_frees_its_tail_without_quarantine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = make_scheduler()
    # A connector that keeps every finished request's blocks until it has sent them
    # (vLLM's delay_free_blocks), reported later through finished_sending.
    monkeypatch.setattr(s, "_connector_finished", lambda request: (True, None))
    s.add_request(make_request("a", list(range(100, 100 + BLOCK + 3)), max_tokens=2))
    reasons: dict[str, str] = {}
    while "a" not in reasons:
        so = s.schedule()
        reasons.update(finish_reasons(s.update_from_output(so, model_output(s, so))))
    core = s.kvguard_pool.core
    (table,) = s.kv_cache_manager.get_block_ids("a")  # still held by the connector
    assert core.block_state(table[-1]) is BlockState.WRITTEN
    s._free_blocks(s.requests["a"])  # the connector reports it sent them
    assert core.block_state(table[-1]) is BlockState.FREE
    assert core.stats().counters.blocks_quarantined == 0
    assert not s._kvguard_clean  # nothing left behind for a later request of that id
    s.kvguard_pool.check_consistency()
