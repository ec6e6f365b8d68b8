"""Smoke test for ``benchmarks/vllm_scheduler.py`` on a tiny trace (subprocess: vLLM's
import configures logging)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_scheduler.py"


@pytest.mark.parametrize("mode", [[], ["--async-scheduling"], ["--control"]])
def test_scheduler_benchmark_runs_both_schedulers_on_one_trace(mode: list[str]) -> None:
    env = dict(os.environ)
    env.pop("KVGUARD_CHECK_INVARIANTS", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--requests", "12", "--rounds", "2", *mode],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert len(re.findall(r"^round \d: \d+ steps", out, re.M)) == 2
    second = "stock#2" if "--control" in mode else "guarded"
    ratio = re.search(rf"ratio {second}/stock = (\d+\.\d+)", out)
    assert ratio is not None and 0.5 < float(ratio.group(1)) < 5
    assert "schedule():" in out and "update_from_output():" in out
