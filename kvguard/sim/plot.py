"""The sweep plot: corruption escapes and prefix hit rate against the fault rate."""

from __future__ import annotations

from kvguard.sim.runner import SimulationReport


def write_plot(report: SimulationReport, path: str) -> None:
    """Two panels side by side, one line per policy; needs matplotlib (``kvguard[sim]``)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(s.policy for s in report.sweep))
    fig, (ax_esc, ax_hit) = plt.subplots(1, 2, figsize=(9, 3.4), constrained_layout=True)
    markers = ["o", "s", "^", "D", "v"]
    for i, name in enumerate(policies):
        points = sorted((s.fault_rate, s) for s in report.sweep if s.policy == name)
        rates = [r for r, _ in points]
        style = {"marker": markers[i % len(markers)], "label": name, "alpha": 0.85}
        ax_esc.plot(rates, [s.escapes for _, s in points], **style)
        ax_hit.plot(rates, [100 * s.hit_rate for _, s in points], **style)
    ax_esc.set_xlabel("fault rate (fraction of requests)")
    ax_esc.set_ylabel("corruption escapes (requests)")
    ax_esc.set_title("unfaulted requests with wrong output")
    ax_hit.set_xlabel("fault rate (fraction of requests)")
    ax_hit.set_ylabel("prefix hit rate (%)")
    ax_hit.set_title("prefix-cache + CPU-tier hits")
    ax_esc.legend(fontsize=8)
    fig.suptitle(f"kvguard simulate --scenario {report.scenario.name}", fontsize=10)
    fig.savefig(path, dpi=90)
    plt.close(fig)
