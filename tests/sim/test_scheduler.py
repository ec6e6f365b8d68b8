"""Scheduler invariants, checked on every step of a run under memory pressure."""

from __future__ import annotations

import pytest

from kvguard.sim import POLICIES, SCENARIOS
from kvguard.sim.engine import Engine
from kvguard.sim.faults import plan_faults
from kvguard.sim.model import TinyDecoder
from kvguard.sim.runner import ground_truth
from kvguard.sim.scheduler import Scheduler, SchedulerOutput
from kvguard.sim.sequence import SeqStatus
from kvguard.sim.workload import make_workload

# Few blocks: preemption and eviction happen; invariants are checked on every mutation.
SCENARIO = SCENARIOS["ci"].with_overrides(num_requests=24, num_blocks=24, check_invariants=True)


@pytest.mark.parametrize("policy", ["eager", "kvguard"])
def test_every_step_respects_budget_and_limits(policy: str) -> None:
    model = TinyDecoder(SCENARIO.model)
    workload = make_workload(SCENARIO)
    faults = plan_faults(workload, 0.3, SCENARIO.fault_kinds, num_layers=2, seed=SCENARIO.seed)
    engine = Engine(SCENARIO, POLICIES[policy], model, workload, faults)
    sched = engine.scheduler
    outputs: list[SchedulerOutput] = []
    original = Scheduler.schedule

    def checked(self: Scheduler, step: int) -> SchedulerOutput:
        out = original(self, step)
        outputs.append(out)
        computed = sum(c.end - c.start for c in out.chunks)
        assert computed <= SCENARIO.max_batched_tokens
        assert len(self.running) <= SCENARIO.max_running
        ids = [c.seq.request_id for c in out.chunks]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        for c in out.chunks:
            assert c.seq.status is SeqStatus.RUNNING
            assert c.end <= len(c.seq.tokens), "scheduled a token that does not exist yet"
            assert c.seq.spec.arrival_step <= step, "scheduled before it arrived"
            assert c.end - c.start >= 1
        assert all(s.status is SeqStatus.WAITING for s in self.waiting)
        return out

    sched.schedule = checked.__get__(sched)  # type: ignore[method-assign]
    result = engine.run()
    assert sum(o.preempted for o in outputs) >= 1, "the scenario must exercise preemption"
    assert any(len({c.start for c in o.chunks}) > 1 for o in outputs)
    assert all(o.finished or o.error for o in result.outcomes.values())
    # Chunked prefill: some prompt was split over several steps.
    stats = engine.pool.stats()
    assert stats.num_requests == 0, "every request was freed"
    assert stats.num_free == SCENARIO.num_blocks


def test_preemption_and_eviction_do_not_change_outputs() -> None:
    """Under heavy pressure, fault-free outputs equal those of a roomy engine."""
    roomy = ground_truth(SCENARIO.with_overrides(num_blocks=200, check_invariants=False))
    tight = ground_truth(SCENARIO)
    assert tight == roomy
