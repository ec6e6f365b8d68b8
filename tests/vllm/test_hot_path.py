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


@pytest.mark.parametrize("unchecked", [False, True])
def test_async_block_cached_while_an_output_is_processed_is_published(unchecked: bool) -> None:
    """Under async scheduling vLLM caches a block whose last token only just became
    known while it processes an output (``cache_blocks`` in ``update_from_output``),
    not while scheduling a step. Its writes all reported: it is published then, and
    serves a hit as in stock vLLM -- unless that output had no NaN count for the
    request: then only a later counted step of the request could vouch for it, and
    here the request ends with that output, so the block is quarantined."""
    prompt = list(range(100, 100 + 2 * BLOCK - 2))  # its 3 tokens complete block 1
    hits = []
    for guarded in (False, True):
        s = make_scheduler(guarded=guarded, async_scheduling=True)
        s.add_request(make_request("a", prompt, max_tokens=3))
        pending: list[Any] = []
        reasons: dict[str, str] = {}
        while "a" not in reasons:
            pending.append(s.schedule())
            if len(pending) == 2:
                so = pending.pop(0)
                output = model_output(s, so)
                if guarded and unchecked and s.requests["a"].num_output_placeholders == 1:
                    del output.num_nans_in_logits["a"]  # the last output, completing block 1
                reasons.update(finish_reasons(s.update_from_output(so, output)))
        for so in pending:
            s.update_from_output(so, model_output(s, so))
        # The newcomer repeats a's tokens: block 1 holds a's prompt tail and outputs.
        s.add_request(make_request("b", prompt + [5, 5, 7, 7], max_tokens=1))
        hits.append(s.schedule().scheduled_new_reqs[0].num_computed_tokens)
        if guarded:
            s.kvguard_pool.check_consistency()
            stats = s.kvguard_stats()
            assert stats["steps_unchecked"] == int(unchecked)
            assert stats["blocks_quarantined"] == int(unchecked)
    stock, guarded_hit = hits
    assert stock == 2 * BLOCK
    assert guarded_hit == (BLOCK if unchecked else 2 * BLOCK)


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
