"""Smoke test for ``benchmarks/pool_ops.py --quick`` (run in a subprocess: the vLLM
import configures logging and emits import-time warnings we keep out of this process)."""

from __future__ import annotations

import importlib.util

import pytest

from .helpers import run_benchmark

ROWS = (
    "(a) alloc 1 + free, per pair",
    "(b) alloc 32 + free, per batch",
    "(c) prompt allocation, per request",
    "(c) decode step",
    "(c) free, per request",
)


def _run(*args: str) -> str:
    return run_benchmark("pool_ops.py", "--quick", *args, timeout=120)


def _row(out: str, name: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith(name))
    return line[len(name) :].split()


def test_quick_kvguard_only() -> None:
    out = _run("--no-vllm")
    for name in ROWS:
        kvguard_us, vllm_us, ratio = _row(out, name)
        assert float(kvguard_us) > 0
        assert (vllm_us, ratio) == ("-", "-")
    assert "vLLM baseline skipped" in out
    # The shared 512-token prefix of 1,024-token prompts hits for all but the first request.
    assert "(c) prefix hit rate  kvguard: 48.8%" in out


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_quick_against_vllm() -> None:
    out = _run()
    assert "baseline: vLLM 0.33" in out
    for name in ROWS:
        kvguard_us, vllm_us, ratio = _row(out, name)
        assert float(kvguard_us) > 0
        assert float(vllm_us) > 0
        assert float(ratio) > 0
    rates = [line.split(":", 1)[1] for line in out.splitlines() if "prefix hit rate" in line]
    assert len(rates) == 2
    assert rates[0].strip() == rates[1].strip()  # both pools hit the same prefix


def test_pool_build_runs() -> None:
    """``benchmarks/pool_build.py`` on a small pool: a time and a size per side."""
    out = run_benchmark("pool_build.py", "--blocks", "2000", "--repeats", "1", timeout=120)
    line = next(line for line in out.splitlines() if line.startswith("kvguard "))
    _, took, _, size, _ = line.split()
    assert float(took) >= 0 and 40 < float(size) < 1000
