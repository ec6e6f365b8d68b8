"""``kvguard simulate``: a fault-injection simulator on a real paged KV cache.

A tiny seeded transformer runs over a paged KV cache whose blocks come from
:class:`kvguard.BlockPool`; a vLLM-like scheduler (token budget, chunked prefill,
preemption, async scheduling, a CPU offload tier) serves a workload of requests sharing
system prompts; faults are injected at a seeded rate; and each policy's outputs are
compared with a fault-free run of the same workload. See ``docs/simulator.md``.

Importing this package imports torch; ``import kvguard`` never imports it.
"""

from kvguard.sim.config import (
    POLICIES,
    SCENARIOS,
    FaultKind,
    ModelConfig,
    Policy,
    Scenario,
)
from kvguard.sim.progress import Progress
from kvguard.sim.report import (
    format_lost_steps,
    format_report,
    format_table,
    report_json,
    write_json,
)
from kvguard.sim.runner import (
    PolicySummary,
    SimulationReport,
    ground_truth,
    run_policy,
    simulate,
    summarize,
)

__all__ = [
    "POLICIES",
    "SCENARIOS",
    "FaultKind",
    "ModelConfig",
    "Policy",
    "PolicySummary",
    "Progress",
    "Scenario",
    "SimulationReport",
    "format_lost_steps",
    "format_report",
    "format_table",
    "ground_truth",
    "report_json",
    "run_policy",
    "simulate",
    "summarize",
    "write_json",
]
