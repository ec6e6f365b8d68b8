"""Smoke tests for the benchmarks that run vLLM: ``benchmarks/vllm_scheduler.py`` on a
tiny trace and ``benchmarks/pool_ops.py --quick`` against vLLM's block pool (subprocess:
vLLM's import configures logging). Rows and their shape are checked, never a speed."""

from __future__ import annotations

import re

import pytest

from ..helpers import run_benchmark
from ..test_benchmark_smoke import ROWS, is_figure, row, run_quick

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")


def test_pool_ops_quick_against_vllm() -> None:
    out = run_quick()
    assert f"baseline: vLLM {vllm.__version__}" in out
    for name in ROWS:
        figures = row(out, name)  # kvguard us, vLLM us, ratio
        assert len(figures) == 3 and all(is_figure(f) for f in figures), (name, figures)
    rates = [line.split(":", 1)[1] for line in out.splitlines() if "prefix hit rate" in line]
    assert len(rates) == 2
    assert rates[0].strip() == rates[1].strip()  # both pools hit the same prefix


@pytest.mark.parametrize(
    "mode",
    [
        [],
        ["--async-scheduling"],
        ["--control"],
        ["--output-tokens", "64", "96"],
        ["--groups", "full,sliding", "--window", "64"],
        ["--offload"],
        # A GPU pool small enough to evict, prompts revisited: both sides load back.
        ["--offload", "simple-cpu", "--blocks", "64", "--revisit", "1"],
        ["--offload", "simple-cpu-lazy", "--blocks", "64", "--revisit", "1", "--async-scheduling"],
        ["--spec-tokens", "3"],
        ["--spec-tokens", "2", "--async-scheduling"],
        ["--seal", "--offload", "simple-cpu", "--blocks", "64", "--revisit", "1"],
    ],
)
def test_scheduler_benchmark_runs_both_schedulers_on_one_trace(mode: list[str]) -> None:
    out = run_benchmark("vllm_scheduler.py", "--requests", "12", "--rounds", "2", *mode)
    assert len(re.findall(r"^round \d: \d+ steps", out, re.M)) == 2
    second = "stock#2" if "--control" in mode else "guarded"
    ratio = re.search(rf"ratio {second}/stock = (\d+\.\d+)", out)
    assert ratio is not None and is_figure(ratio.group(1))
    assert "schedule():" in out and "update_from_output():" in out
    low, high = mode[1:] if "--output-tokens" in mode else ("8", "64")
    assert f"output tokens {low}..{int(high) - 1}" in out
    groups = mode[1].replace(",", "+") if "--groups" in mode else "full"
    assert f"KV cache groups {groups}" in out
    if "--spec-tokens" in mode:
        drafts = re.search(r"drafts, per round: stock (\d+) of (\d+) accepted", out)
        assert drafts is not None and 0 < int(drafts.group(1)) < int(drafts.group(2))
        assert f"speculative decoding ({mode[1]} draft tokens)" in out
    if "--seal" in mode:
        sealed = re.search(r"seals, per round: (\d+) blocks sealed, 0 loads refused", out)
        assert sealed is not None and int(sealed.group(1)) > 0, out
        assert "seals on (the guarded side)" in out
    if mode == ["--offload"]:
        jobs = re.search(r"offloading, per round: stock (\d+) store / \d+ load jobs", out)
        assert jobs is not None and int(jobs.group(1)) > 0
        assert "CPU offloading (OffloadingConnector)" in out
    elif "--offload" in mode:
        blocks = re.search(
            r"SimpleCPU offloading, per round: stock (\d+) blocks stored / (\d+) loaded "
            r"\(\d+ / \d+ events\), guarded (\d+) / (\d+) ",
            out,
        )
        assert blocks is not None and all(int(n) > 0 for n in blocks.groups()), out
        lazy = "lazy" if "simple-cpu-lazy" in mode else "eager"
        assert f"CPU offloading (SimpleCPUOffloadConnector, {lazy})" in out


def test_scheduler_benchmark_with_lmcache() -> None:
    """``--offload lmcache``: LMCache's scheduler side on both sides (vLLM 0.33 and
    older: the series LMCache 0.5.6 drives); a pool small enough to evict and the
    prompts revisited, so both sides save and load."""
    pytest.importorskip("lmcache", reason="LMCache's real package (pip install lmcache)")
    from dataclasses import fields

    from vllm.v1.core.sched.output import CachedRequestData

    if "resumed_req_ids" not in {f.name for f in fields(CachedRequestData)}:
        pytest.skip("LMCache 0.5.6's adapter does not drive vLLM 0.34 (no resumed_req_ids)")
    out = run_benchmark(
        "vllm_scheduler.py",
        *("--requests", "12", "--rounds", "2", "--offload", "lmcache"),
        *("--blocks", "64", "--revisit", "1"),
    )
    assert "CPU offloading (LMCacheConnectorV1)" in out
    counts = re.search(
        r"LMCache, per round: stock (\d+) chunks saved / (\d+) tokens loaded "
        r"\(\d+ saves / \d+ loads\), guarded (\d+) / (\d+) ",
        out,
    )
    assert counts is not None and all(int(n) > 0 for n in counts.groups()), out
    ratio = re.search(r"ratio guarded/stock = (\d+\.\d+)", out)
    assert ratio is not None and is_figure(ratio.group(1))
