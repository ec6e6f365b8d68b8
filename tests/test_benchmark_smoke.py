"""Smoke test for ``benchmarks/pool_ops.py --quick`` (run in a subprocess: the vLLM
import configures logging and emits import-time warnings we keep out of this process)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "pool_ops.py"
ROWS = (
    "(a) alloc 1 + free, per pair",
    "(b) alloc 32 + free, per batch",
    "(c) prompt allocation, per request",
    "(c) decode step",
    "(c) free, per request",
)


def _run(*args: str) -> str:
    env = dict(os.environ)
    env.pop("KVGUARD_CHECK_INVARIANTS", None)  # time the pool, not the checker
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


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
