"""A rank fault loses the whole step, as in a real engine: every request with a step in
flight rolls back (kvguard) or is aborted (the others), and the simulator reports what
each approach recomputes -- on the real-engine trace of tests/e2e/test_recover.py, the
same figures as vLLM's guarded scheduler (tests/vllm/test_recover.py checks those)."""

from __future__ import annotations

import pytest

from kvguard.sim import format_lost_steps
from kvguard.sim.runner import summarize

from .lost_step import EXPECTED, recompute, run_trace


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_kvguard_rolls_back_every_request_of_the_lost_step(async_scheduling: bool) -> None:
    result = run_trace("kvguard", async_scheduling=async_scheduling)
    assert recompute(result) == EXPECTED[async_scheduling]
    c = result.counters
    rolled_back = sum(r for r, _ in EXPECTED[async_scheduling].values())
    assert (c.steps_lost, c.requests_in_lost_steps) == (1, 2)
    assert c.tokens_in_lost_steps == c.tail_slots_wiped == rolled_back
    assert c.tokens_if_blocks_dropped == sum(d for _, d in EXPECTED[async_scheduling].values())
    # b was never faulted itself: it resumes all the same, and both finish exactly as
    # without the fault.
    reference = run_trace("kvguard", async_scheduling=async_scheduling, fault=False)
    assert {rid: o.recoveries for rid, o in result.outcomes.items()} == {"a": 1, "b": 1}
    assert result.outcomes["b"].fault is None
    assert {rid: o.output for rid, o in result.outcomes.items()} == {
        rid: o.output for rid, o in reference.outcomes.items()
    }


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_defer_zero_all_aborts_every_request_of_the_lost_step(async_scheduling: bool) -> None:
    result = run_trace("defer-zero-all", async_scheduling=async_scheduling)
    assert {rid: o.error for rid, o in result.outcomes.items()} == dict.fromkeys(
        "ab", "rank failure"
    )
    c = result.counters
    assert (c.steps_lost, c.tail_slots_wiped) == (1, 0)
    # What resubmitting the aborted requests recomputes, next to kvguard's rollback.
    expected = EXPECTED[async_scheduling]
    assert recompute(result) == {rid: (0, dropped) for rid, (_, dropped) in expected.items()}
    assert c.tokens_in_lost_steps == sum(r for r, _ in expected.values())


def test_eager_does_not_see_the_lost_step() -> None:
    """vLLM 0.33 as modelled: the step's garbage KV stays and both requests go wrong."""
    result = run_trace("eager", async_scheduling=False)
    reference = run_trace("kvguard", async_scheduling=False, fault=False)
    assert result.counters.steps_lost == 0
    assert all(o.finished for o in result.outcomes.values())
    for rid, o in result.outcomes.items():
        assert o.output != reference.outcomes[rid].output, rid


def test_the_report_sets_the_rollback_beside_dropping_blocks() -> None:
    clean = run_trace("kvguard", async_scheduling=False, fault=False)
    reference = {rid: o.output for rid, o in clean.outcomes.items()}
    summaries = [
        summarize(run_trace(name, async_scheduling=False), reference)
        for name in ("eager", "defer-zero-all", "kvguard")
    ]
    lines = format_lost_steps(summaries).splitlines()
    assert lines[0].startswith("policy") and lines[0].endswith("drop blocks / resubmit")
    # eager does not notice the loss: no row.
    assert [line.split() for line in lines[2:4]] == [
        ["defer-zero-all", "1", "2", "64", "0", "96"],
        ["kvguard", "1", "2", "64", "64", "96"],
    ]
    assert lines[4] == ""
    assert format_lost_steps(summaries[:1]) == ""
