"""The simulator's outputs: a table per policy, and a JSON document of everything."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from kvguard.sim.config import FaultKind
from kvguard.sim.metrics import RunCounters
from kvguard.sim.runner import PolicySummary, SimulationReport

COLUMNS: tuple[tuple[str, str], ...] = (
    ("policy", "policy"),
    ("requests", "requests"),
    ("completed", "completed"),
    ("aborted", "aborted"),
    ("recovered", "recovered"),
    ("escapes", "escapes"),
    ("faulted_silent", "silent wrong"),
    ("hit_rate", "hit rate"),
    ("bytes_zeroed", "zeroed"),
    ("tier_entries_from_failed_steps", "bad tier entries"),
    ("tier_rotten_loads_served", "rotten tier loads served/refused"),
    ("tokens_per_s", "tok/s"),
)


LOST_STEP_COLUMNS: tuple[tuple[str, str], ...] = (
    ("steps_lost", "lost steps"),
    ("requests_in_lost_steps", "requests"),
    ("tokens_in_lost_steps", "in flight"),
    ("tail_slots_wiped", "rolled back"),
    ("tokens_if_blocks_dropped", "drop blocks / resubmit"),
)
"""The rank-failure table: counters of :class:`~kvguard.sim.metrics.RunCounters`."""


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _cell(summary: PolicySummary, key: str) -> str:
    value = getattr(summary, key)
    if key == "hit_rate":
        return f"{value:.1%}"
    if key == "bytes_zeroed":
        return _human_bytes(value)
    if key == "tier_entries_from_failed_steps":
        return f"{value}/{summary.tier_entries_written}"
    if key == "tier_rotten_loads_served":
        return f"{value}/{summary.tier_loads_refused}"
    if key == "tokens_per_s":
        return f"{value:,.0f}"
    return str(value)


def format_table(summaries: Sequence[PolicySummary]) -> str:
    """A fixed-width table, one row per policy."""
    rows = [[title for _, title in COLUMNS]]
    rows += [[_cell(s, key) for key, _ in COLUMNS] for s in summaries]
    return _fixed_width(rows)


def format_lost_steps(summaries: Sequence[PolicySummary]) -> str:
    """What the rank failures cost, one row per policy that saw a step lost (empty if
    none did): tokens recomputed by its recovery, next to the approaches it is
    compared with."""
    rows = [["policy", *(title for _, title in LOST_STEP_COLUMNS)]]
    for s in summaries:
        counters: RunCounters = s.result.counters
        if counters.steps_lost:
            rows.append([s.policy, *(str(getattr(counters, k)) for k, _ in LOST_STEP_COLUMNS)])
    if len(rows) == 1:
        return ""
    legend = (
        "rank failures: each loses its step for every request with one in flight, as in a "
        "real engine (eager does not notice);\nin flight: tokens the lost steps computed, "
        "what rolling back to the validated boundary recomputes;\nrolled back: tokens the "
        "policy's recovery rolled back and recomputed (zero_request_tail; 0: it aborts);\n"
        "drop blocks / resubmit: what dropping the touched blocks and preempting (vLLM PR "
        "#50265), or aborting and resubmitting, recomputes (published full blocks kept)"
    )
    return f"{_fixed_width(rows)}\n\n{legend}"


def _fixed_width(rows: list[list[str]]) -> str:
    """Rows of cells, the first one the header: left-aligned first column, the others
    right-aligned, a rule under the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_report(report: SimulationReport) -> str:
    sc = report.scenario
    faulted = {s.policy: s.faulted for s in report.main}
    head = (
        f"scenario {sc.name!r}: {sc.num_requests} requests, {sc.num_system_prompts} shared "
        f"system prompts, {sc.num_blocks} blocks x {sc.block_size} tokens, "
        f"{'async' if sc.async_scheduling else 'sync'} scheduling, fault rate "
        f"{sc.fault_rate:g} ({', '.join(k.value for k in sc.fault_kinds)}), seed {sc.seed}"
    )
    legend = (
        "escapes: requests never faulted themselves whose output differs from the fault-free "
        "run;\nsilent wrong: faulted requests that completed with a wrong output and no "
        "error;\nrecovered: faulted requests that completed with exactly the reference "
        "output;\nbad tier entries: CPU-tier copies written by failed steps / all written;\n"
        "rotten tier loads: loads of CPU-tier copies altered once stored (--faults tier), "
        "computed on / refused by their seals; "
        f"faults fired per policy: {faulted}"
    )
    lost = format_lost_steps(report.main)
    out = f"{head}\n\n{format_table(report.main)}\n\n{legend}"
    return f"{out}\n\n{lost}" if lost else out


def _summary_json(s: PolicySummary) -> dict[str, Any]:
    out = {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name != "result"}
    c = s.result.counters
    out["counters"] = dataclasses.asdict(c)
    out["requests_detail"] = [dataclasses.asdict(o) for o in s.result.outcomes.values()]
    return out


def report_json(report: SimulationReport) -> dict[str, Any]:
    sc = dataclasses.asdict(report.scenario)
    sc["fault_kinds"] = [k.value for k in report.scenario.fault_kinds]
    return {
        "scenario": sc,
        "ground_truth_s": report.ground_truth_s,
        "guarded_escapes": report.guarded_escapes,
        "main": [_summary_json(s) for s in report.main],
        "sweep": [
            {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name != "result"}
            for s in report.sweep
        ],
    }


def write_json(report: SimulationReport, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report_json(report), f, indent=1, default=_default)
        f.write("\n")


def _default(value: object) -> object:
    if isinstance(value, FaultKind):
        return value.value
    raise TypeError(f"cannot serialise {value!r}")
