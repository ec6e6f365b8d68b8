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
