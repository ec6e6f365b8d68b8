"""The sweep plot: what each policy delivers and pays, against the fault rate.

Three panels share the x axis (the fault rate):

* **escapes**: requests never faulted themselves that got a wrong output, from another
  request's bad KV. Above 0 is the failure kvguard exists to prevent.
* **bytes zeroed**: the cost of zeroing (0 for a policy that never zeroes).
* **hit rate**: prefix-cache + CPU-tier hits, on the full 0-100 % scale, so that a
  gap of a few points looks like one (a zoomed axis makes 3 points look like a cliff).

Policies often coincide (every guarded policy has 0 escapes; kvguard and kvguard-audit
zero the same bytes). So that no line hides another, each policy has its own marker and
line style, its points are nudged sideways by a fixed step, and each panel names the
policies that lie on one line (:func:`coinciding`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvguard.sim.runner import PolicySummary, SimulationReport

MARKERS = ("o", "s", "^", "D", "v")
LINESTYLES = ("-", "--", ":", "-.")
DODGE = 0.03
"""Sideways step between policies, as a fraction of the fault-rate span."""
FOOT = 0.22
"""Height of the band under the panels (legend and caption), relative to the panels'."""
CAPTION = (
    "Left: any escape above 0 is a request that was never faulted but got a wrong output from "
    "another request's bad KV.\nMiddle and right: what isolation costs. The hit-rate axis runs "
    "from 0 to 100 %, so a gap of a few points looks like one.\nPoints are nudged sideways so "
    "that coinciding policies stay visible; boxes name the policies that lie on one line."
)
NEAR = 0.01
"""Series closer than this fraction of their panel's y span are drawn as one line."""


def coinciding(series: Mapping[str, Sequence[float]], tol: float = 0.0) -> list[list[str]]:
    """Groups of two or more names whose series agree point by point within ``tol``.

    A series joins the first group whose first series it matches (same length, every
    point within ``tol``, absolute); groups and names keep the input order.
    """
    groups: list[list[str]] = []
    for name, ys in series.items():
        for group in groups:
            first = series[group[0]]
            if len(first) == len(ys) and all(
                abs(a - b) <= tol for a, b in zip(first, ys, strict=True)
            ):
                group.append(name)
                break
        else:
            groups.append([name])
    return [g for g in groups if len(g) > 1]


def coincidence_note(series: Mapping[str, Sequence[float]], span: float, unit: str) -> str:
    """One line per group that would be drawn as one line on an axis of ``span``:
    "identical: a, b" when equal, else "within <largest gap><unit>: a, b"."""
    lines = []
    for group in coinciding(series, tol=NEAR * span):
        gap = max(
            abs(a - b) for n in group for a, b in zip(series[group[0]], series[n], strict=True)
        )
        head = "identical" if gap == 0 else f"within {gap:.2g}{unit}"
        lines.append(f"{head}: {', '.join(group)}")
    return "\n".join(lines)


def _bytes_unit(largest: float) -> tuple[str, float]:
    for unit, size in (("GiB", 1024.0**3), ("MiB", 1024.0**2), ("KiB", 1024.0)):
        if largest >= size:
            return unit, size
    return "B", 1.0


@dataclass(frozen=True, slots=True)
class _Panel:
    title: str
    ylabel: str
    metric: Callable[[PolicySummary], float]
    unit: str
    """Appended to a gap in the coincidence note."""
    full_scale: float | None = None
    """A fixed top of the y axis; None: fit the data, with room for the note."""
    integer: bool = False


def _panels(report: SimulationReport) -> list[_Panel]:
    unit, size = _bytes_unit(max(s.bytes_zeroed for s in report.sweep))
    return [
        _Panel(
            "escapes: wrong output, never faulted",
            f"requests (of {report.scenario.num_requests})",
            lambda s: s.escapes,
            "",
            integer=True,
        ),
        _Panel(
            "bytes zeroed (the cost of zeroing)", unit, lambda s: s.bytes_zeroed / size, f" {unit}"
        ),
        _Panel(
            "prefix + CPU-tier hit rate",
            "% of tokens looked up",
            lambda s: 100 * s.hit_rate,
            " pts",
            full_scale=100.0,
        ),
    ]


def sweep_figure(report: SimulationReport) -> Any:
    """The figure (a ``matplotlib.figure.Figure``) of a report with a sweep; needs
    matplotlib (``kvguard[sim]``). Every y axis starts at 0."""
    if not report.sweep:
        raise ValueError("the report has no sweep to plot (run with --sweep rates)")
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    policies = list(dict.fromkeys(s.policy for s in report.sweep))
    points = {
        name: sorted((s for s in report.sweep if s.policy == name), key=lambda s: s.fault_rate)
        for name in policies
    }
    rates = sorted({s.fault_rate for s in report.sweep})
    step = DODGE * ((rates[-1] - rates[0]) or 1.0)
    panels = _panels(report)
    fig = plt.figure(figsize=(12, 4.6), layout="constrained")
    grid = fig.add_gridspec(2, len(panels), height_ratios=(1, FOOT))
    axes = [fig.add_subplot(grid[0, i]) for i in range(len(panels))]
    for ax, panel in zip(axes, panels, strict=True):
        series = {name: [panel.metric(s) for s in points[name]] for name in policies}
        for i, name in enumerate(policies):
            offset = (i - (len(policies) - 1) / 2) * step
            ax.plot(
                [s.fault_rate + offset for s in points[name]],
                series[name],
                marker=MARKERS[i % len(MARKERS)],
                linestyle=LINESTYLES[i % len(LINESTYLES)],
                color=f"C{i}",
                label=name,
                alpha=0.9,
                clip_on=False,  # whole markers on the 0 line
            )
        top = panel.full_scale
        if top is None:
            top = max(1.45 * max(max(ys) for ys in series.values()), 1.0)  # room for the note
        ax.set_ylim(0, top)
        ax.yaxis.set_major_locator(MaxNLocator(integer=panel.integer))
        note = coincidence_note(series, top, panel.unit)
        if note:
            ax.text(
                0.02,
                0.97,
                note,
                transform=ax.transAxes,
                va="top",
                fontsize=7.5,
                bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.85},
            )
        ax.set_title(panel.title, fontsize=10)
        ax.set_ylabel(panel.ylabel)
        ax.set_xlabel("fault rate (fraction of requests)")
        ax.set_xticks(rates)
        ax.grid(alpha=0.3)
    sc = report.scenario
    fig.suptitle(
        f"kvguard simulate --scenario {sc.name} ({sc.num_requests} requests, seed {sc.seed}): "
        "does bad KV reach other requests, and what does keeping it out cost?",
        fontsize=10.5,
    )
    foot = fig.add_subplot(grid[1, :])  # the legend and the caption, under the panels
    foot.axis("off")
    foot.legend(
        *axes[0].get_legend_handles_labels(),
        loc="upper center",
        ncol=len(policies),
        fontsize=8.5,
        frameon=False,
    )
    foot.text(
        0.5,
        0.0,
        CAPTION,
        transform=foot.transAxes,
        ha="center",
        va="bottom",
        fontsize=8,
        color="0.25",
    )
    return fig


def write_plot(report: SimulationReport, path: str) -> None:
    """Write :func:`sweep_figure` as a PNG; needs matplotlib (``kvguard[sim]``)."""
    import matplotlib.pyplot as plt

    fig = sweep_figure(report)
    fig.savefig(path, dpi=90)
    plt.close(fig)
