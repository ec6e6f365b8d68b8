from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Iterator

import pytest

if importlib.util.find_spec("vllm") is not None:
    # vLLM and torch emit deprecation warnings of their own at import time; the
    # project's "warnings are errors" rule is for kvguard's code, not theirs.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from . import harness  # noqa: F401


@pytest.fixture(autouse=True)
def _nan_counting_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # The guard refuses to start without vLLM's per-request NaN counts.
    monkeypatch.setenv("VLLM_COMPUTE_NANS_IN_LOGITS", "1")
    yield


@pytest.fixture
def per_request_nans(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What kvguard's plugin does with ``KVGUARD_GUARD=1`` for speculative decoding:
    vLLM's model runners count NaNs per request (``worker_nans.install``), which lets
    the guarded scheduler take drafts. Undone after the test."""
    import sys

    from kvguard.adapters.vllm import worker_nans

    monkeypatch.setenv("KVGUARD_GUARD", "1")
    monkeypatch.setattr(worker_nans, "_installed", False)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    v1 = sys.modules.get(worker_nans.V1_RUNNER)
    if v1 is not None:
        monkeypatch.setattr(v1, "count_nans_per_row", v1.count_nans_per_row)
        runner = v1.GPUModelRunner
        monkeypatch.setattr(runner, "_bookkeeping_sync", runner._bookkeeping_sync)
        monkeypatch.setattr(runner, "_get_nans_in_logits", runner._get_nans_in_logits)
    v2 = sys.modules.get(worker_nans.V2_RUNNER)
    if v2 is not None:
        monkeypatch.setattr(v2.GPUModelRunner, "sample", v2.GPUModelRunner.sample)
    worker_nans.install()
    yield
