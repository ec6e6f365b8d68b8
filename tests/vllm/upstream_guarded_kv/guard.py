"""The guarded mode of vLLM 0.34's own KV-cache tests (see conftest.py here): the pool
and manager classes the vendored tests build, and how a module here collects them.

"Given clean outputs" at the KV-cache level, where no scheduler steps exist: every call
that caches blocks is a step whose output came back clean once it returns.

- A step is a call of ``KVCacheManager.allocate_slots`` or ``.cache_blocks``, of a
  single-type manager's ``cache_blocks`` that the test makes itself, or of the pool's
  ``cache_full_blocks`` / ``cache_partial_block`` that the test makes itself. When the
  outermost one returns, what kvguard's pool held back for it is validated: the pool's
  outbox (``block_pool.take_cached()``) handed to ``block_pool.validate_fills``, as a
  guarded scheduler validates a step's fills when its output is clean. A step that
  raises validates nothing.
- The guarded scheduler's ``settles`` rule (:meth:`CleanSteps.settles`): tokens of a
  request that a step which returned covered were written by steps that all reported
  clean. Blocks cached over such tokens are validated before any block is released (the
  pool's question on every release, ``window_frees``, takes the outbox first), and a
  Mamba checkpoint's copy-on-write (``block_pool.take_copies()``) publishes its copy
  then, as under a guarded scheduler.
- Releases vLLM makes for a request whose steps all came back clean -- a single-type
  manager's ``free(request_id)`` (``KVCacheManager.free``) and its
  ``remove_skipped_blocks`` (window, R-SWA gap, retired Mamba states) -- say so
  (``steps_passed``: the guarded scheduler's ``free_blocks(..., steps_passed=True)``
  for a request leaving after a clean step, and its window frees): unvalidated blocks
  (a partial tail) are validated as they are released, and an attention tail entry
  (``cache_partial_block``) is published then. Every other release -- a test's own
  ``block_pool.free_blocks``, vLLM's frees outside those two -- goes as vLLM's own calls
  go: unvalidated blocks are quarantined.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import vllm
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.single_type_kv_cache_manager import MambaManager

from kvguard.adapters.vllm._compat import series_of
from kvguard.adapters.vllm.config import GuardConfig
from kvguard.adapters.vllm.pool.block_pool import GuardedBlockPool
from kvguard.adapters.vllm.pool.manager import (
    GUARDED_MANAGERS,
    _guarded_cow,
    _guarded_mamba_allocation,
    install_guarded_pool,
)
from tests.vllm.upstream.conftest import OTHER_SERIES

SERIES = "0.34"
VENDORED = "tests.vllm.upstream.v0_34"
"""The vendored tests' package (``tests/vllm/upstream/v0_34/``)."""

MODULES = (
    "test_prefix_caching",
    "test_single_type_kv_cache_manager",
    "test_partial_prefix_cache_primitives",
)
"""The vendored KV-cache test modules collected again here."""

GUARD = GuardConfig(enabled=True, check_invariants=True)
"""The guard on, kvguard's pool checked after every change."""


class CleanSteps:
    """One guarded pool's steps: validation when the outermost step returns, the
    ``settles`` rule, and how releases go (see the module docstring)."""

    def __init__(self) -> None:
        self.pool: GuardedBlockPool | None = None
        self.held: list[int] = []
        """Blocks the steps running now fill, taken from the pool's outbox, not settled."""
        self.depth = 0
        self.clean_releases = 0
        """> 0 while vLLM releases blocks for a request whose steps came back clean."""
        self.reported: dict[str, int] = {}
        """Request id -> its tokens covered by steps that returned (reported clean)."""
        self.caching: dict[str, int] = {}
        """Request id -> its tokens cached by the step running now."""

    def attach(self, pool: GuardedBlockPool) -> None:
        self.pool = pool
        pool.window_frees = self.window_frees

    def settles(self, request_id: str, num_tokens: int) -> bool:
        return num_tokens <= self.reported.get(request_id, 0)

    def window_frees(self, block_ids: list[int]) -> bool | None:
        """The pool's question on every release (:attr:`GuardedBlockPool.window_frees`),
        after what was cached is taken (settled blocks validated before any release):
        True inside a clean release, else None (vLLM's own call: as its caller said)."""
        self._take_cached()
        return True if self.clean_releases else None

    def _take_cached(self) -> None:
        """The pool's outbox: blocks cached over settled tokens, and copies of settled
        states, validated now; other blocks held for the step's end; other copies'
        entries withdrawn."""
        pool = self.pool
        assert pool is not None
        settled: list[int] = []
        held = self.held
        for owner, block_ids, num_tokens, once in pool.take_cached():
            if self.settles(owner, num_tokens):
                settled += block_ids
            elif not (once and block_ids[0] in held):
                held += block_ids
        for owner, block_id, num_tokens in pool.take_copies():
            if self.settles(owner, num_tokens):
                settled.append(block_id)
            else:
                pool.withdraw([block_id])
        if settled:
            pool.validate_fills(settled)

    def step(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``call(*args, **kwargs)`` as a step; validated when the outermost returns."""
        self.depth += 1
        try:
            result = call(*args, **kwargs)
        except BaseException:
            self.depth -= 1
            if not self.depth:
                self._drop()
            raise
        self.depth -= 1
        if not self.depth:
            self._validate()
        return result

    def cached(self, request: Any, num_tokens: int) -> None:
        """The step running now caches the request's first ``num_tokens`` tokens."""
        req_id = request.request_id
        self.caching[req_id] = max(self.caching.get(req_id, 0), num_tokens)

    @contextmanager
    def clean_release(self) -> Iterator[None]:
        self.clean_releases += 1
        try:
            yield
        finally:
            self.clean_releases -= 1

    def _validate(self) -> None:
        pool = self.pool
        assert pool is not None
        self._take_cached()
        filled, self.held = self.held, []
        if filled:
            pool.validate_fills(filled)
        for req_id, num_tokens in self.caching.items():
            self.reported[req_id] = max(self.reported.get(req_id, 0), num_tokens)
        self.caching.clear()
        pool.check_consistency()

    def _drop(self) -> None:
        """A step that raised: what it noted is never validated (its blocks stay
        unvalidated, quarantined on release)."""
        pool = self.pool
        assert pool is not None
        dropped = [b for _, ids, _, _ in pool.take_cached() for b in ids]
        dropped += [block_id for _, block_id, _ in pool.take_copies()]
        pool.withdraw([*dropped, *self.held])
        self.held = []
        self.caching.clear()


def _guard_pool_calls(pool: GuardedBlockPool, steps: CleanSteps) -> None:
    """The pool's caching calls are steps when the test makes them itself (inside a
    manager's step they are part of it)."""
    cache_full_blocks = pool.cache_full_blocks
    cache_partial_block = pool.cache_partial_block

    def cache_full(*args: Any, **kwargs: Any) -> Any:
        return steps.step(cache_full_blocks, *args, **kwargs)

    def cache_partial(*args: Any, **kwargs: Any) -> Any:
        return steps.step(cache_partial_block, *args, **kwargs)

    pool.cache_full_blocks = cache_full  # type: ignore[method-assign]
    pool.cache_partial_block = cache_partial  # type: ignore[method-assign]


def _guard_manager_calls(single: Any, steps: CleanSteps) -> None:
    """A single-type manager's ``cache_blocks`` is a step (nested in the
    ``KVCacheManager``'s when it calls it); its ``free`` and ``remove_skipped_blocks``
    are clean releases."""
    cache_blocks = single.cache_blocks
    free = single.free
    remove_skipped_blocks = single.remove_skipped_blocks

    def cache(*args: Any, **kwargs: Any) -> Any:
        # cache_blocks(request, num_tokens, ...), by position or by name.
        named = dict(zip(("request", "num_tokens"), args, strict=False)) | kwargs
        steps.cached(named["request"], named["num_tokens"])
        return steps.step(cache_blocks, *args, **kwargs)

    def free_clean(request_id: str) -> None:
        with steps.clean_release():
            free(request_id)
        steps.reported.pop(request_id, None)  # (a later request may reuse the id)

    def remove_skipped_clean(*args: Any, **kwargs: Any) -> Any:
        with steps.clean_release():
            return remove_skipped_blocks(*args, **kwargs)

    single.cache_blocks = cache
    single.free = free_clean
    single.remove_skipped_blocks = remove_skipped_clean


class CleanGuardedBlockPool(GuardedBlockPool):
    """What the vendored tests build for vLLM's ``BlockPool``: kvguard's pool (guard
    on, invariants checked), its caching calls steps that come back clean."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        steps = CleanSteps()
        super().__init__(*args, guard=GUARD, **kwargs)
        steps.attach(self)
        self.clean_steps = steps
        _guard_pool_calls(self, steps)


class CleanGuardedKVCacheManager(KVCacheManager):
    """What the vendored tests build for vLLM's ``KVCacheManager``: vLLM's manager on
    kvguard's pool (:func:`install_guarded_pool`, guard on, invariants checked), each
    ``allocate_slots`` / ``cache_blocks`` a step that comes back clean."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        steps = CleanSteps()
        pool = install_guarded_pool(self, GUARD)
        steps.attach(pool)
        pool.clean_steps = steps
        self.clean_steps = steps
        _guard_pool_calls(pool, steps)
        for single in self.coordinator.single_type_managers:
            _guard_manager_calls(single, steps)

    def allocate_slots(self, *args: Any, **kwargs: Any) -> Any:
        return self.clean_steps.step(super().allocate_slots, *args, **kwargs)

    def cache_blocks(self, *args: Any, **kwargs: Any) -> Any:
        return self.clean_steps.step(super().cache_blocks, *args, **kwargs)


class _OnGuardedPool:
    """Mixed in front of a vLLM single-type manager the test builds itself: on a pool of
    :class:`CleanGuardedBlockPool`, it is wired as :func:`install_guarded_pool` wires
    the managers of a ``KVCacheManager`` (copy-on-write references, Mamba's state
    group), and its calls are steps and clean releases as there."""

    block_pool: Any
    kv_cache_group_id: int
    _apply_cow: Any
    allocate_new_blocks: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        pool = self.block_pool
        if not isinstance(pool, CleanGuardedBlockPool):
            return  # (a pool of the test's own: vLLM's manager as it is)
        self._apply_cow = _guarded_cow(pool, self._apply_cow)
        if isinstance(self, MambaManager):
            pool.state_groups = pool.state_groups | {self.kv_cache_group_id}
            self.allocate_new_blocks = _guarded_mamba_allocation(pool, self)
        _guard_manager_calls(self, pool.clean_steps)


GUARDED_MANAGER_NAMES: dict[type, type] = {
    manager: type(manager.__name__, (_OnGuardedPool, manager), {"__doc__": _OnGuardedPool.__doc__})
    for manager in GUARDED_MANAGERS
}
"""vLLM's single-type manager class -> what a vendored module names by it here."""

GUARDED: dict[type, type] = {
    BlockPool: CleanGuardedBlockPool,
    KVCacheManager: CleanGuardedKVCacheManager,
    **GUARDED_MANAGER_NAMES,
}
"""vLLM's class -> what a vendored KV-cache module names by it in guarded mode."""


def guard_vendored_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every vendored KV-cache module (:data:`MODULES`) that names one of
    :data:`GUARDED`'s vLLM classes names the guarded one instead, until
    ``monkeypatch`` undoes it. (Their functions read their module's names when called:
    the stock run of the same modules, before or after, is untouched.)"""
    for name in MODULES:
        module = importlib.import_module(f"{VENDORED}.{name}")
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and value in GUARDED:
                monkeypatch.setattr(module, attr, GUARDED[value])


def vendored_tests(name: str) -> dict[str, Any]:
    """The namespace of the vendored test module ``name`` (its tests, fixtures and
    ``pytestmark``; not its dunder names), for a module here to collect a second time
    (conftest.py here deselects the tests it does not select). On another series than
    0.34 the calling module is skipped, as the vendored one is."""
    if series_of(vllm.__version__) != SERIES:
        reason = OTHER_SERIES.format(vendored=SERIES, installed=vllm.__version__)
        pytest.skip(reason, allow_module_level=True)
    module = importlib.import_module(f"{VENDORED}.{name}")
    return {k: v for k, v in vars(module).items() if not k.startswith("__")}
