"""Smoke test for ``benchmarks/pool_ops.py --quick`` (run in a subprocess: the vLLM
import configures logging and emits import-time warnings we keep out of this process).
Rows and their shape are checked, never a speed; against vLLM:
tests/vllm/test_benchmark_smoke.py."""

from __future__ import annotations

import math

from .helpers import run_benchmark

ROWS = (
    "(a) alloc 1 + free, per pair",
    "(b) alloc 32 + free, per batch",
    "(c) prompt allocation, per request",
    "(c) decode step",
    "(c) free, per request",
)


def run_quick(*args: str) -> str:
    return run_benchmark("pool_ops.py", "--quick", *args)


def row(out: str, name: str) -> list[str]:
    """The figures of row ``name``: kvguard us, vLLM us, ratio."""
    line = next((line for line in out.splitlines() if line.startswith(name)), None)
    assert line is not None, f"no row {name!r} in:\n{out}"
    return line[len(name) :].split()


def is_figure(text: str) -> bool:
    """A time or a ratio as printed: a finite number, not negative (a fast operation
    may print 0.0)."""
    try:
        value = float(text)
    except ValueError:
        return False
    return math.isfinite(value) and value >= 0


def test_quick_kvguard_only() -> None:
    out = run_quick("--no-vllm")
    for name in ROWS:
        kvguard_us, vllm_us, ratio = row(out, name)
        assert is_figure(kvguard_us), (name, kvguard_us)
        assert (vllm_us, ratio) == ("-", "-")
    assert "vLLM baseline skipped" in out
    # The shared 512-token prefix of 1,024-token prompts hits for all but the first request.
    assert "(c) prefix hit rate  kvguard: 48.8%" in out


def test_pool_build_runs() -> None:
    """``benchmarks/pool_build.py`` on a small pool: a time and a size per side."""
    out = run_benchmark("pool_build.py", "--blocks", "2000", "--repeats", "1")
    line = next(line for line in out.splitlines() if line.startswith("kvguard "))
    _, took, _, size, _ = line.split()
    assert is_figure(took) and 40 < float(size) < 1000
