"""vLLM 0.33's own KV-cache tests, vendored unmodified (see each file's header).

The modules here are vLLM's unit tests for ``BlockPool``, ``KVCacheManager`` and the
single-type managers. They used to run a second time on kvguard's pass-through pool;
pass-through is now vLLM's own ``BlockPool`` (kvguard builds nothing with the guard off,
see tests/vllm/test_pass_through.py), so they run once, on vLLM's pool: the control for
the installed vLLM, with the skip list :data:`SKIPPED` (by test name).

Run: ``HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu python -m pytest tests/vllm/upstream``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import vllm

from kvguard.adapters.vllm._compat import series_of

_HERE = "tests/vllm/upstream/"

_REPO_HELPERS = (
    "imports a helper from vLLM's repository test tree that is not vendored here "
    "({}), so it cannot be imported"
)

SKIPPED: dict[str, str] = {
    # module::test (all its parametrizations) -> why it is skipped
    "test_prefix_caching.py::test_nixl_hisparse_full_block_import_keeps_a_writable_tail": (
        _REPO_HELPERS.format(
            "tests.v1.kv_connector.unit.utils.create_vllm_config, which also builds a "
            "ModelConfig for facebook/opt-125m from the Hugging Face hub: offline here"
        )
    ),
    "test_prefix_caching.py::test_hisparse_async_admission_requires_full_prompt_host_pages": (
        _REPO_HELPERS.format(
            "tests/v1/core/utils.py via `from .utils import`, which itself imports "
            "tests.v1.kv_connector.unit.utils"
        )
    ),
    "test_prefix_caching.py::test_hisparse_admitted_async_loads_can_finish_with_nothing_running": (
        _REPO_HELPERS.format(
            "tests/v1/core/utils.py via `from .utils import`, which itself imports "
            "tests.v1.kv_connector.unit.utils"
        )
    ),
}

VENDORED_SERIES = "0.33"
"""The vLLM series these files were vendored from."""

OTHER_SERIES = (
    "vLLM {vendored}.0's own unit tests, vendored from its sdist; the installed vLLM "
    "{installed} lacks the APIs they call (e.g. get_request_block_hasher's third "
    "argument, KVCacheManager(num_hash_lookahead_tokens=...)), so they fail there on "
    "vLLM's stock pool too. The adapter suite (tests/vllm) covers {installed}."
)


def pytest_configure(config: pytest.Config) -> None:
    # Markers of vLLM's own test suite (registered by its pyproject.toml).
    config.addinivalue_line("markers", "cpu_test: vLLM marker, a test that runs on CPU")
    config.addinivalue_line(
        "markers", "skip_global_cleanup: vLLM marker, skip its repo-level cleanup fixture"
    )


def _key(item: pytest.Item) -> str:
    # "tests/vllm/upstream/test_x.py::test_f[params]" -> "test_x.py::test_f"
    return item.nodeid.split("[", 1)[0].rsplit("/", 1)[-1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    installed = series_of(vllm.__version__)
    for item in items:
        if _HERE not in item.path.as_posix():
            continue
        if installed != VENDORED_SERIES:
            reason: str | None = OTHER_SERIES.format(
                vendored=VENDORED_SERIES, installed=vllm.__version__
            )
        else:
            reason = SKIPPED.get(_key(item))
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
