"""Smoke tests for ``benchmarks/kernels.py``: the quick benchmark and the launch-shape
sweep run and print every row (in a subprocess, as a user runs them). Rows and their
shape are checked, never a speed."""

from __future__ import annotations

import pytest

from ..helpers import run_benchmark
from ..test_benchmark_smoke import is_figure
from .cases import ON_GPU

pytest.importorskip("torch")
pytest.importorskip("triton")


def _run(*args: str, interpret: bool) -> str:
    interpreter = "1" if interpret and not ON_GPU else None
    return run_benchmark("kernels.py", "--quick", *args, env={"TRITON_INTERPRET": interpreter})


ROWS = [
    "zero_blocks flash_attn",
    "zero_blocks 16 ids",
    "zero_slots",
    "audit_blocks",
    "seal_blocks",
    "zero_blocks flashinfer",
    "zero_blocks mla",
    "nan_count",
]


def test_quick_benchmark_prints_every_row() -> None:
    out = _run(interpret=False)
    lines = [
        line for line in out.splitlines() if line.startswith(("zero_", "audit_", "seal_", "nan_"))
    ]
    assert len(lines) == len(ROWS), out
    for line, name in zip(lines, ROWS, strict=True):
        assert line.startswith(name), (line, name)
        vs_copy, vs_torch = line.split()[-2:]
        assert vs_copy.endswith("x") and vs_torch.endswith("x"), line
        assert is_figure(vs_copy[:-1]) and is_figure(vs_torch[:-1]), line


def test_sweep_ranks_every_launch_shape() -> None:
    out = _run("--sweep", interpret=True)
    kernels = (
        ("zero_blocks", 16),
        ("audit_blocks", 8),
        ("seal_blocks", 8),
        ("count_nonfinite", 16),
    )
    for kernel, shapes in kernels:
        assert f"{kernel}: {shapes} launch shapes" in out
    ranked = [line for line in out.splitlines() if line.lstrip().startswith("#")]
    # The best five of each kernel, and its current shape's rank where it ranks lower.
    lower = [line for line in ranked if int(line.split()[0][1:]) > 5]
    assert all(line.endswith("<- current") for line in lower)
    assert len(ranked) - len(lower) == 5 * len(kernels)
