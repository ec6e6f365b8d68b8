"""Rank failures: each loses its whole step; kvguard rolls every request of it back with
zero_request_tail and resumes them from their surviving KV (outputs equal the
fault-free reference), defer-zero-all aborts them."""

from __future__ import annotations

import pytest

from kvguard.sim import POLICIES, SCENARIOS, FaultKind
from kvguard.sim.runner import ground_truth, run_policy, summarize

SCENARIO = SCENARIOS["ci"].with_overrides(
    num_requests=16, fault_kinds=(FaultKind.RANK_FAILURE,), check_invariants=True
)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_rank_failures_recover_to_the_reference(async_scheduling: bool) -> None:
    scenario = SCENARIO.with_overrides(async_scheduling=async_scheduling)
    reference = ground_truth(scenario)
    result = run_policy(scenario, POLICIES["kvguard"], 1.0)
    s = summarize(result, reference)
    recovered = [o for o in result.outcomes.values() if o.recoveries]
    assert len(recovered) >= 3
    assert all(o.finished and o.output == reference[o.request_id] for o in recovered)
    assert s.aborted == 0 and s.escapes == 0 and s.faulted_silent == 0
    assert s.recovered == s.faulted
    c = result.counters
    assert c.tail_slots_wiped == c.tokens_in_lost_steps > 0
    assert c.requests_in_lost_steps == sum(o.recoveries for o in result.outcomes.values())
    assert c.requests_in_lost_steps > c.steps_lost  # a step holds more than its faulted request
    # Dropping the touched blocks (vLLM PR #50265) or resubmitting recomputes more.
    assert c.tokens_if_blocks_dropped > c.tokens_in_lost_steps
    assert c.tail_slots_wiped == sum(o.tokens_rolled_back for o in result.outcomes.values())


def test_without_the_tail_primitive_rank_failures_abort() -> None:
    reference = ground_truth(SCENARIO)
    result = run_policy(SCENARIO, POLICIES["defer-zero-all"], 1.0)
    s = summarize(result, reference)
    assert s.faulted >= 3
    assert s.escapes == 0 and s.faulted_silent == 0
    for o in result.outcomes.values():
        if o.fault is not None and o.finished:
            # Only a request preempted before its failed step's result arrived escapes
            # the abort: its in-flight KV was dropped and recomputed from scratch.
            assert o.preemptions >= 1 and o.recoveries == 0
            assert o.output == reference[o.request_id]
    assert s.aborted >= s.faulted - sum(
        1 for o in result.outcomes.values() if o.fault and o.preemptions
    )
    # A lost step takes the other requests in flight with it.
    assert s.aborted_unfaulted >= 1
    c = result.counters
    assert c.aborts["rank failure"] == c.requests_in_lost_steps
    assert c.tail_slots_wiped == 0 and c.tokens_in_lost_steps > 0
