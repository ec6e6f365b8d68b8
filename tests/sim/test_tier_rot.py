"""Tier rot in the simulator: a CPU-tier copy altered after it was stored (finite values,
no NaN) is served by every policy that trusts its tier, and refused by kvguard, which
verifies each load by the seal its block got when its step validated."""

from __future__ import annotations

import pytest

from kvguard.sim import POLICIES, SCENARIOS, SimulationReport, simulate
from kvguard.sim.config import FaultKind
from kvguard.sim.runner import PolicySummary

SCENARIO = SCENARIOS["ci"].with_overrides(
    fault_kinds=(FaultKind.TIER_ROT,), fault_rate=0.5, sweep=(0.5,), check_invariants=True
)


@pytest.fixture(scope="module")
def report() -> SimulationReport:
    policies = [POLICIES[name] for name in ("eager", "defer-zero-all", "kvguard")]
    return simulate(SCENARIO, policies)


def _by_name(report: SimulationReport) -> dict[str, PolicySummary]:
    return {s.policy: s for s in report.main}


@pytest.mark.parametrize("name", ["eager", "defer-zero-all"])
def test_a_policy_that_trusts_its_tier_serves_rotten_copies(
    report: SimulationReport, name: str
) -> None:
    s = _by_name(report)[name]
    counters = s.result.counters
    assert counters.tier_entries_rotten >= 1
    assert s.tier_rotten_loads_served >= 1 and s.tier_loads_refused == 0
    assert s.escapes >= 1  # readers of a rotten copy answered wrongly, without an error
    assert s.aborted == 0


def test_kvguard_refuses_every_rotten_load_and_recomputes(report: SimulationReport) -> None:
    s = _by_name(report)["kvguard"]
    counters = s.result.counters
    assert counters.tier_entries_rotten >= 1
    assert s.tier_rotten_loads_served == 0
    assert s.tier_loads_refused >= 1
    # Nobody answered wrongly, nobody failed: the refused tokens were recomputed.
    assert s.escapes == 0 and s.faulted_silent == 0 and s.aborted == 0
    assert s.completed == s.requests
    assert report.guarded_escapes == 0


def test_the_table_has_the_rotten_loads_column(report: SimulationReport) -> None:
    from kvguard.sim.report import format_table

    table = format_table(report.main)
    assert "rotten tier loads served/refused" in table.splitlines()[0]
    kvguard = next(line for line in table.splitlines() if line.startswith("kvguard "))
    assert f"0/{_by_name(report)['kvguard'].tier_loads_refused}" in kvguard
