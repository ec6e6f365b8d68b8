"""Smoke test for ``benchmarks/vllm_engine.py``: one stock/guarded pair of a small trace
through two real engines (each in a process of its own, as the benchmark runs them)."""

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
        timeout=300,
    )
    assert "schedulers: stock Scheduler, guarded GuardedScheduler" in out
    assert "outputs identical on both engines: yes" in out
    pair = re.search(r"engines 1, pair 1: stock +([\d.]+) tok/s, guarded +([\d.]+) tok/s", out)
    assert pair is not None, out
    assert float(pair[1]) > 0 and float(pair[2]) > 0
    assert re.search(r"ratio guarded/stock, every pair: median [\d.]+ \(min", out)
    assert re.search(r"geometric mean of the engine pairs' medians: [\d.]+ ", out)
