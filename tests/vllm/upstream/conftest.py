"""vLLM's own KV-cache tests, vendored unmodified from each supported CUDA series'
sdist (``v0_33/``, ``v0_34/``; see each file's header).

The modules here are vLLM's unit tests for ``BlockPool``, ``KVCacheManager`` and the
single-type managers. They used to run a second time on kvguard's pass-through pool;
pass-through is now vLLM's own ``BlockPool`` (kvguard builds nothing with the guard off,
see tests/vllm/test_pass_through.py), so they run once, on vLLM's pool: the control for
the installed vLLM, each series' tests on that series only (the folder names it), with
the skip list :data:`SKIPPED` (by test name).

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
    "v0_34/test_prefix_caching.py::test_nixl_hisparse_full_block_import_keeps_a_writable_tail": (
        _REPO_HELPERS.format(
            "tests.v1.kv_connector.unit.utils.create_vllm_config, which also builds a "
            "ModelConfig for facebook/opt-125m from the Hugging Face hub: offline here"
        )
    ),
    "v0_34/test_prefix_caching.py::test_hisparse_admitted_async_loads_can_finish_with_nothing_running": (  # noqa: E501
        _REPO_HELPERS.format(
            "tests/v1/core/utils.py via `from .utils import`, which itself imports "
            "tests.v1.kv_connector.unit.utils"
        )
    ),
    "v0_34/test_prefix_caching.py::test_hisparse_async_admission_fits_beside_inflight_import": (
        _REPO_HELPERS.format(
            "tests/v1/core/utils.py via `from .utils import`, which itself imports "
            "tests.v1.kv_connector.unit.utils"
        )
    ),
    "v0_34/test_prefix_caching.py::test_hisparse_import_reservation_does_not_gate_local_admissions": (  # noqa: E501
        _REPO_HELPERS.format(
            "tests/v1/core/utils.py via `from .utils import`, which itself imports "
            "tests.v1.kv_connector.unit.utils"
        )
    ),
    "v0_34/test_prefix_caching.py::test_hisparse_import_reservation_released": (
        _REPO_HELPERS.format(
            "tests/v1/core/utils.py via `from .utils import`, which itself imports "
            "tests.v1.kv_connector.unit.utils"
        )
    ),
}

OTHER_SERIES = (
    "vLLM {vendored}.0's own unit tests, vendored from its sdist, test the API of that "
    "series; the installed vLLM {installed} differs (0.32 lacks get_request_block_hasher's "
    "third argument and KVCacheManager(num_hash_lookahead_tokens=...), 0.34 changed "
    "KVCacheBlock.pool and free_blocks), so they fail there on vLLM's stock pool too. "
    "The adapter suite (tests/vllm) covers {installed}."
)


def vendored_series(item: pytest.Item) -> str:
    """``"0.34"`` for a test in ``upstream/v0_34/``."""
    return item.path.parent.name[1:].replace("_", ".")


def pytest_configure(config: pytest.Config) -> None:
    # Markers of vLLM's own test suite (registered by its pyproject.toml).
    config.addinivalue_line("markers", "cpu_test: vLLM marker, a test that runs on CPU")
    config.addinivalue_line(
        "markers", "skip_global_cleanup: vLLM marker, skip its repo-level cleanup fixture"
    )


def _key(item: pytest.Item) -> str:
    # "tests/vllm/upstream/v0_33/test_x.py::test_f[params]" -> "v0_33/test_x.py::test_f"
    return item.nodeid.split("[", 1)[0].split(_HERE, 1)[-1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    installed = series_of(vllm.__version__)
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
