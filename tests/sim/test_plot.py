"""The sweep plot tells coinciding policies apart and starts every axis at 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvguard.sim import SCENARIOS, SimulationReport
from kvguard.sim.metrics import RunCounters, RunResult
from kvguard.sim.plot import coincidence_note, coinciding
from kvguard.sim.runner import PolicySummary


def test_coinciding_groups_equal_series_in_input_order() -> None:
    series = {"a": [0.0, 1.0], "b": [0.0, 2.0], "c": [0.0, 1.0], "d": [0.0, 2.0], "e": [5.0, 5.0]}
    assert coinciding(series) == [["a", "c"], ["b", "d"]]


def test_coinciding_needs_every_point_within_the_tolerance() -> None:
    series = {"a": [1.0, 2.0, 3.0], "b": [1.0, 2.0, 3.2], "c": [1.0, 2.0]}
    assert coinciding(series) == []
    assert coinciding(series, tol=0.25) == [["a", "b"]]  # c is shorter: never one line


def test_coincidence_note_says_identical_or_how_close() -> None:
    series = {"eager": [72.0, 72.0], "x": [69.0, 68.0], "y": [69.0, 67.8], "z": [69.0, 67.8]}
    assert coincidence_note(series, 100.0, " pts") == "within 0.2 pts: x, y, z"
    assert coincidence_note(series, 10.0, " pts") == "identical: y, z"
    assert coincidence_note({"a": [1.0], "b": [3.0]}, 100.0, "") == ""


def _summary(policy: str, rate: float, escapes: int, zeroed: int, hit_rate: float) -> PolicySummary:
    return PolicySummary(
        policy=policy,
        fault_rate=rate,
        requests=48,
        completed=48,
        aborted=0,
        faulted=0,
        recovered=0,
        escapes=escapes,
        faulted_silent=0,
        aborted_unfaulted=0,
        hit_rate=hit_rate,
        bytes_zeroed=zeroed,
        tier_entries_written=0,
        tier_entries_from_failed_steps=0,
        tier_rotten_loads_served=0,
        tier_loads_refused=0,
        tokens_per_s=0.0,
        result=RunResult(policy, rate, {}, RunCounters()),
    )


@pytest.fixture
def figure() -> Any:
    pytest.importorskip("matplotlib")
    from kvguard.sim.plot import sweep_figure

    sweep = [
        s
        for rate in (0.0, 0.3)
        for s in (
            _summary("eager", rate, 10 if rate else 0, 0, 0.72),
            _summary("defer-zero-all", rate, 0, 500_000, 0.685),
            _summary("kvguard", rate, 0, 60_000, 0.68),
            _summary("kvguard-audit", rate, 0, 60_000, 0.68),
        )
    ]
    fig = sweep_figure(SimulationReport(SCENARIOS["ci"], [], sweep, 0.0))
    yield fig
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_the_plot_tells_coinciding_policies_apart(figure: Any) -> None:
    escapes, zeroed, hits = figure.axes[:3]
    notes = [[t.get_text() for t in ax.texts] for ax in (escapes, zeroed, hits)]
    assert notes[0] == ["identical: defer-zero-all, kvguard, kvguard-audit"]
    assert notes[1] == ["identical: kvguard, kvguard-audit"]
    assert notes[2] == ["within 0.5 pts: defer-zero-all, kvguard, kvguard-audit"]
    for ax in (escapes, zeroed, hits):
        lines = ax.get_lines()
        assert len({line.get_marker() for line in lines}) == 4
        assert len({line.get_linestyle() for line in lines}) == 4
        firsts = [line.get_xdata()[0] for line in lines]  # all at fault rate 0, dodged
        assert len(set(firsts)) == 4 and max(firsts) - min(firsts) < 0.1


def test_every_axis_starts_at_0_and_the_hit_rate_spans_0_to_100(figure: Any) -> None:
    escapes, zeroed, hits = figure.axes[:3]
    assert escapes.get_ylim()[0] == zeroed.get_ylim()[0] == 0
    assert hits.get_ylim() == (0, 100)
    assert escapes.get_ylim()[1] >= 10 and zeroed.get_ylabel() == "KiB"


def test_write_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from kvguard.sim.plot import write_plot

    sweep = [_summary("kvguard", 0.0, 0, 0, 0.5), _summary("eager", 0.0, 0, 0, 0.5)]
    path = tmp_path / "sweep.png"
    write_plot(SimulationReport(SCENARIOS["ci"], [], sweep, 0.0), str(path))
    assert path.read_bytes().startswith(b"\x89PNG")
