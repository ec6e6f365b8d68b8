"""Smoke test for ``benchmarks/block_zeroing.py --quick`` (in a subprocess, as a user runs
it). That its vendored copy of vLLM's zeroing kernel is the installed vLLM's is checked
with the adapter's tests (tests/vllm/test_vendored_zeroer.py), where vLLM is installed."""

from __future__ import annotations

import importlib.util
import math

from .helpers import run_benchmark

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _numbers(out: str, label: str, count: int, column: int) -> list[float]:
    """The figures of the row ``label`` whose ``column``-th figure, the blocks zeroed a
    call, is ``count``."""
    for line in out.splitlines():
        if line.startswith(label + " "):
            fields = line[len(label) :].split()
            if int(fields[column]) == count:
                return [float(f) for f in fields]
    raise AssertionError(f"no row {label!r} for {count} blocks in:\n{out}")


def _figures(values: list[float]) -> bool:
    """Times and ratios as the benchmark prints them: finite, not negative. Never more
    (a fast call prints 0.0 us; how fast is for the benchmark to say, not a test)."""
    return all(math.isfinite(v) and v >= 0 for v in values)


def test_quick_run_times_every_row() -> None:
    """CPU rows: both vLLM loops and kvguard, each cache, 1/8/64 blocks. Triton rows, with
    no GPU here: under the interpreter on tiny CPU caches (the run also checks that each
    side zeroes exactly the named blocks), or skipped and said so without triton. The
    rows' shape is checked, never their speed."""
    env = {"TRITON_INTERPRET": "1" if HAS_TRITON else None}
    out = run_benchmark("block_zeroing.py", "--quick", env=env)
    assert "machine: " in out
    for cache in ("tiny-fp32", "tiny-bf16", "llama8b-bf16"):
        for count in (1, 8, 64):
            # layers, blocks, MiB, kvguard us, vLLM 0.32 us, ratio, vLLM 0.34 us, ratio
            layers, _, mib, *times = _numbers(out, f"cpu {cache}", count, column=1)
            assert layers > 0 and mib > 0 and len(times) == 5
            assert _figures(times), times
    if not HAS_TRITON:
        assert "Triton rows skipped" in out
        return
    for layout in ("flash_attn", "flashinfer", "mla"):
        for count in (1, 3):
            # blocks, MiB, kvguard us, vLLM us, kvguard GB/s, vLLM GB/s, ratio
            # (tiny caches: MiB prints as 0.0)
            _, *figures = _numbers(out, f"interp {layout}", count, column=0)
            assert len(figures) == 6 and _figures(figures), figures
