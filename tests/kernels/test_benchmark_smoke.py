"""Smoke tests for ``benchmarks/kernels.py``: the quick benchmark and the launch-shape
sweep run and print every row (in a subprocess, as a user runs them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"


def _run(*args: str, interpret: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret and os.environ.get("KVGUARD_KERNEL_DEVICE", "cpu") == "cpu":
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


ROWS = [
    "zero_blocks flash_attn",
    "zero_blocks 16 ids",
    "zero_slots",
    "audit_blocks",
    "zero_blocks flashinfer",
    "zero_blocks mla",
    "nan_count",
]


def test_quick_benchmark_prints_every_row() -> None:
    out = _run(interpret=False)
    lines = [line for line in out.splitlines() if line.startswith(("zero_", "audit_", "nan_"))]
    assert len(lines) == len(ROWS), out
    for line, name in zip(lines, ROWS, strict=True):
        assert line.startswith(name), (line, name)
        vs_copy, vs_torch = line.split()[-2:]
        assert vs_copy.endswith("x") and float(vs_torch.rstrip("x")) > 0


def test_sweep_ranks_every_launch_shape() -> None:
    out = _run("--sweep", interpret=True)
    for kernel, shapes in (("zero_blocks", 16), ("audit_blocks", 8), ("count_nonfinite", 16)):
        assert f"{kernel}: {shapes} launch shapes" in out
    ranked = [line for line in out.splitlines() if line.lstrip().startswith("#")]
    assert len(ranked) == 15  # the best five of each kernel
