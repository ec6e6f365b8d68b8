"""vLLM 0.33's own KV-cache tests, run on kvguard's pass-through pool.

The modules here are vLLM's unit tests for ``BlockPool``, ``KVCacheManager`` and the
single-type managers, vendored unmodified (see each file's header). The autouse
fixture :func:`_pool` runs every one of them twice:

* ``stock``: on vLLM's own ``vllm.v1.core.block_pool.BlockPool`` (the control);
* ``kvguard-passthrough``: every ``BlockPool(...)`` the test builds, directly or through
  ``KVCacheManager`` (``KVCacheCoordinator.__init__``) or a ``Scheduler``, is a
  :class:`~kvguard.adapters.vllm.GuardedBlockPool` with ``GuardConfig(enabled=False)``.

Both runs must pass, with the same skip list (:data:`SKIPPED`, applied by test name
whatever the pool). The fixture also checks that the patch reached every pool: a test
on ``kvguard-passthrough`` that builds a stock ``BlockPool`` fails, as does a ``stock``
test that builds a ``GuardedBlockPool``. Subclasses vLLM builds for other purposes
(HiSparse's ``SharedEventQueueBlockPool`` host pool) are left as they are.

Run: ``HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu python -m pytest tests/vllm/upstream``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

import vllm
import vllm.v1.core.block_pool as vllm_block_pool
import vllm.v1.core.kv_cache_coordinator as vllm_coordinator

from kvguard.adapters.vllm import GuardConfig, GuardedBlockPool
from kvguard.adapters.vllm._compat import series_of

StockBlockPool: Any = vllm_block_pool.BlockPool

_HERE = "tests/vllm/upstream/"

_REPO_HELPERS = (
    "imports a helper from vLLM's repository test tree that is not vendored here "
    "({}), so it cannot be imported in either run"
)

SKIPPED: dict[str, str] = {
    # module::test (all its parametrizations, on both pools) -> why it is skipped
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

POOLS = ("stock", "kvguard-passthrough")
PASS_THROUGH = GuardConfig(enabled=False)


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


@pytest.fixture(autouse=True, params=POOLS)
def _pool(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Which pool the test's ``BlockPool(...)`` / ``KVCacheManager(...)`` builds."""
    mode: str = request.param
    built: list[Any] = []  # every BlockPool (or subclass) the test builds
    stock_init = StockBlockPool.__init__

    @functools.wraps(stock_init)
    def recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
        built.append(self)
        stock_init(self, *args, **kwargs)

    monkeypatch.setattr(StockBlockPool, "__init__", recording_init)
    if mode == "kvguard-passthrough":
        # The names the test modules and vLLM's code construct the pool by. Called as
        # vLLM calls BlockPool (no ``guard`` argument), GuardedBlockPool is pass-through.
        monkeypatch.setattr(vllm_block_pool, "BlockPool", GuardedBlockPool)
        monkeypatch.setattr(vllm_coordinator, "BlockPool", GuardedBlockPool)
        if getattr(request.module, "BlockPool", None) is StockBlockPool:
            monkeypatch.setattr(request.module, "BlockPool", GuardedBlockPool)
    yield mode
    if mode == "kvguard-passthrough":
        stray = [p for p in built if type(p) is StockBlockPool]
        assert not stray, f"the test built {len(stray)} stock BlockPool(s): patch incomplete"
        guarded = [p for p in built if isinstance(p, GuardedBlockPool)]
        assert all(p.core is None and p.guard == PASS_THROUGH for p in guarded), (
            "a GuardedBlockPool was built in guarded mode"
        )
    else:
        guarded = [p for p in built if isinstance(p, GuardedBlockPool)]
        assert not guarded, f"the stock run built {len(guarded)} GuardedBlockPool(s)"
