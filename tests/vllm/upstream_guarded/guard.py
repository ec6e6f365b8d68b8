"""The guarded mode of vLLM 0.34's own scheduler tests (see conftest.py here): the
scheduler classes the vendored tests build, and how a module here collects them."""

from __future__ import annotations

import copy
import importlib
import sys
from typing import Any

import pytest
import vllm
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput

from kvguard.adapters.vllm._compat import series_of
from kvguard.adapters.vllm.scheduler.guarded import GuardedAsyncScheduler, GuardedScheduler
from tests.vllm.upstream.conftest import OTHER_SERIES

SERIES = "0.34"
VENDORED = "tests.vllm.upstream.v0_34"
"""The vendored tests' package (``tests/vllm/upstream/v0_34/``)."""


def given_clean(output: Any) -> Any:
    """``output`` as a worker counting NaN logits per request hands it over, every
    request clean: a count of 0 for each request it reports that the test gave no count.
    A copy where counts are added (the test's object, which may be shared, stays as it
    was built)."""
    if not isinstance(output, ModelRunnerOutput):
        return output  # (a test's stand-in: the guard sees it as the test built it)
    counts = output.num_nans_in_logits or {}
    missing = [req_id for req_id in output.req_ids if req_id not in counts]
    if not missing:
        return output
    output = copy.copy(output)
    output.num_nans_in_logits = {**dict.fromkeys(missing, 0), **counts}
    return output


class _GivenCleanOutputs:
    """The guarded scheduler, handed every model-runner output :func:`given_clean`."""

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        return super().update_from_output(  # type: ignore[misc]
            scheduler_output, given_clean(model_runner_output)
        )


class CleanGuardedScheduler(_GivenCleanOutputs, GuardedScheduler):
    """What the vendored tests build for vLLM's ``Scheduler``."""


class CleanGuardedAsyncScheduler(_GivenCleanOutputs, GuardedAsyncScheduler):
    """What the vendored tests build for vLLM's ``AsyncScheduler``."""


GUARDED: dict[type, type] = {
    Scheduler: CleanGuardedScheduler,
    AsyncScheduler: CleanGuardedAsyncScheduler,
}
"""vLLM's scheduler class -> what a vendored module names by it in guarded mode."""


def guard_vendored_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every vendored module (the tests and their helpers ``utils.py`` and
    ``kv_connector_unit_utils.py``) that names vLLM's ``Scheduler`` or
    ``AsyncScheduler`` names the guarded class instead, until ``monkeypatch`` undoes
    it. (Their functions read their module's names when called: the stock run of the
    same modules, before or after, is untouched.)"""
    for name, module in list(sys.modules.items()):
        if not name.startswith(f"{VENDORED}."):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and value in GUARDED:
                monkeypatch.setattr(module, attr, GUARDED[value])


def vendored_tests(name: str) -> dict[str, Any]:
    """The namespace of the vendored test module ``name`` (its tests, fixtures and
    ``pytestmark``; not its dunder names), for a module here to collect a second time.
    On another series than 0.34 the calling module is skipped, as the vendored one is."""
    if series_of(vllm.__version__) != SERIES:
        reason = OTHER_SERIES.format(vendored=SERIES, installed=vllm.__version__)
        pytest.skip(reason, allow_module_level=True)
    module = importlib.import_module(f"{VENDORED}.{name}")
    return {k: v for k, v in vars(module).items() if not k.startswith("__")}
