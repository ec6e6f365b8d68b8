"""Run a scenario: the fault-free ground truth, then every policy on the same faults.

Numbers are measured, not assumed: a request's reference output is what the same engine
generated for it with no fault injected, and every policy's outputs are compared with it
token by token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from kvguard.sim.config import KVGUARD, Policy, Scenario
from kvguard.sim.engine import Engine
from kvguard.sim.faults import plan_faults
from kvguard.sim.metrics import RunResult
from kvguard.sim.model import TinyDecoder
from kvguard.sim.workload import RequestSpec, make_workload


@dataclass(frozen=True, slots=True)
class PolicySummary:
    """One policy at one fault rate, judged against the ground truth."""

    policy: str
    fault_rate: float
    requests: int
    completed: int
    aborted: int
    faulted: int
    recovered: int
    """Faulted requests that completed with exactly their reference output."""
    escapes: int
    """Requests never faulted themselves whose output differs from the reference."""
    faulted_silent: int
    """Faulted requests that completed, without an error, with a wrong output."""
    aborted_unfaulted: int
    """Requests aborted although their own step was never faulted (collateral)."""
    hit_rate: float
    bytes_zeroed: int
    tier_entries_written: int
    tier_entries_from_failed_steps: int
    tier_rotten_loads_served: int
    """Loads of tier copies a tier-rot fault altered that a request computed on."""
    tier_loads_refused: int
    """Tier loads refused by their seals (the tokens recomputed)."""
    tokens_per_s: float
    result: RunResult

    @property
    def guarded(self) -> bool:
        from kvguard.sim.config import POLICIES

        return POLICIES[self.policy].guarded if self.policy in POLICIES else False


def summarize(result: RunResult, reference: dict[str, tuple[int, ...]]) -> PolicySummary:
    faulted = recovered = escapes = silent = aborted_unfaulted = completed = 0
    for rid, o in result.outcomes.items():
        completed += o.finished
        if o.fault is not None:
            faulted += 1
            if o.finished:
                if o.output == reference[rid]:
                    recovered += 1
                else:
                    silent += 1
        elif not o.finished:
            aborted_unfaulted += 1
        elif o.output != reference[rid]:
            escapes += 1
    c = result.counters
    return PolicySummary(
        policy=result.policy,
        fault_rate=result.fault_rate,
        requests=len(result.outcomes),
        completed=completed,
        aborted=len(result.outcomes) - completed,
        faulted=faulted,
        recovered=recovered,
        escapes=escapes,
        faulted_silent=silent,
        aborted_unfaulted=aborted_unfaulted,
        hit_rate=c.hit_rate,
        bytes_zeroed=c.bytes_zeroed,
        tier_entries_written=c.tier_entries_written,
        tier_entries_from_failed_steps=c.tier_entries_from_failed_steps,
        tier_rotten_loads_served=c.tier_rotten_loads_served,
        tier_loads_refused=c.tier_loads_refused,
        tokens_per_s=c.tokens_per_s,
        result=result,
    )


def run_policy(
    scenario: Scenario,
    policy: Policy,
    fault_rate: float,
    *,
    model: TinyDecoder | None = None,
    workload: Sequence[RequestSpec] | None = None,
    on_step: Callable[[], None] | None = None,
) -> RunResult:
    """One run of ``policy`` on the scenario's workload with faults at ``fault_rate``."""
    model = model or TinyDecoder(scenario.model)
    workload = workload if workload is not None else make_workload(scenario)
    faults = plan_faults(
        workload,
        fault_rate,
        scenario.fault_kinds,
        num_layers=scenario.model.num_layers,
        seed=scenario.seed,
    )
    with single_thread():
        return Engine(scenario, policy, model, workload, faults, fault_rate).run(on_step)


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run torch on one thread: the tensors are tiny, and intra-op threads only add
    synchronisation (10x slower on a loaded 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def ground_truth(
    scenario: Scenario,
    *,
    model: TinyDecoder | None = None,
    workload: Sequence[RequestSpec] | None = None,
) -> dict[str, tuple[int, ...]]:
    """Each request's output with no fault injected (the reference)."""
    result = run_policy(scenario, KVGUARD, 0.0, model=model, workload=workload)
    unfinished = [rid for rid, o in result.outcomes.items() if not o.finished]
    if unfinished:
        raise RuntimeError(f"fault-free run aborted requests {unfinished}: this is a bug")
    return {rid: o.output for rid, o in result.outcomes.items()}


@dataclass(frozen=True, slots=True)
class SimulationReport:
    scenario: Scenario
    main: list[PolicySummary]
    """Every policy at the scenario's fault rate."""
    sweep: list[PolicySummary]
    """Every policy at every sweep rate (the plot's data)."""
    ground_truth_s: float

    @property
    def guarded_escapes(self) -> int:
        """Escapes (and silent wrong outputs) under kvguard policies, main run and sweep."""
        return sum(s.escapes + s.faulted_silent for s in (*self.main, *self.sweep) if s.guarded)


def simulate(
    scenario: Scenario,
    policies: Sequence[Policy],
    *,
    sweep: Sequence[float] = (),
    on_run: Callable[[str], None] | None = None,
    on_step: Callable[[], None] | None = None,
) -> SimulationReport:
    """Ground truth, then each policy at the scenario's rate and at each sweep rate."""
    import time

    model = TinyDecoder(scenario.model)
    workload = make_workload(scenario)
    t0 = time.perf_counter()
    if on_run is not None:
        on_run("ground truth")
    reference = ground_truth(scenario, model=model, workload=workload)
    gt_s = time.perf_counter() - t0
    summaries: dict[tuple[str, float], PolicySummary] = {}
    rates = [scenario.fault_rate, *(r for r in sweep if r != scenario.fault_rate)]
    for rate in rates:
        for policy in policies:
            if on_run is not None:
                on_run(f"{policy.name} @ {rate:g}")
            result = run_policy(
                scenario, policy, rate, model=model, workload=workload, on_step=on_step
            )
            summaries[policy.name, rate] = summarize(result, reference)
    main = [summaries[p.name, scenario.fault_rate] for p in policies]
    swept = [summaries[p.name, r] for r in sorted(set(sweep)) for p in policies]
    return SimulationReport(scenario, main, swept, gt_s)
