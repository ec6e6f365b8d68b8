from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Iterator

import pytest

from .plugin_patches import undo_plugin_patches_after, undo_runner_patches_after

__all__ = ["undo_plugin_patches_after", "undo_runner_patches_after"]

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
    from kvguard.adapters.vllm.workers import nans as worker_nans

    monkeypatch.setenv("KVGUARD_GUARD", "1")
    undo_runner_patches_after(monkeypatch)
    worker_nans.install()
    yield
