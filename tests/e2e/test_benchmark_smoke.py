"""Smoke test for ``benchmarks/vllm_engine.py``: one stock/guarded pair of a small trace
through two real engines (each in a process of its own, taking turns, as the benchmark
runs them)."""

from __future__ import annotations

import re

import pytest

from ..helpers import run_benchmark
from .conftest import HAVE_ENGINE, SKIP_REASON

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not HAVE_ENGINE, reason=SKIP_REASON)]


def test_one_pair_stock_and_guarded() -> None:
    out = run_benchmark(
        "vllm_engine.py",
        *("--engines", "1", "--rounds", "1", "--requests", "8", "--output-tokens", "8"),
        *("--turn-steps", "4"),
    )
    assert "schedulers: stock Scheduler, guarded GuardedScheduler" in out
    assert "outputs identical on both engines: yes" in out
    run = re.search(r"engines 1, run 1: stock +([\d.]+) tok/s, guarded +([\d.]+) tok/s", out)
    assert run is not None, out
    assert float(run[1]) > 0 and float(run[2]) > 0
    # Both engines did the same steps, taking turns of 4 steps.
    work = re.findall(r"work per run, (?:stock|guarded): (\d+) steps in (\d+) turns", out)
    assert len(work) == 2 and work[0] == work[1], out
    steps, turns = map(int, work[0])
    assert steps > 4 and turns == -(-steps // 4), out
    for part in ("schedule", "execute_model", "sample_tokens", "update_from_output", "rest"):
        assert re.search(rf"^  {part} +stock +[\d.]+  guarded +[\d.]+  [\d.]+$", out, re.M), out
    # The guard's CPU a step outside the forward: a figure, which may be negative (noise).
    assert re.search(r"outside the model forward .*: median -?[\d.]+ µs \(min -?[\d.]+", out), out
    assert re.search(r"ratio guarded/stock, every run: median [\d.]+ \(min", out)
    assert re.search(r"geometric mean of the engine pairs' medians: [\d.]+ ", out)
    assert re.search(r"counted at stock's time in the same run: [\d.]+ \(engine pairs", out)
