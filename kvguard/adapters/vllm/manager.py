"""Building a vLLM ``KVCacheManager`` whose block pool is kvguard's.

vLLM's ``KVCacheCoordinator.__init__`` constructs ``vllm.v1.core.block_pool.BlockPool``
by name, and every single-type manager keeps a reference to it (and to its null
block). :func:`install_guarded_pool` swaps in a :class:`GuardedBlockPool` right after
construction, before any block was handed out — the one supported way, used by
:func:`build_kv_cache_manager` and by the guarded schedulers. With the guard off nothing
is swapped: vLLM's own pool runs (pass-through is vLLM's own classes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvguard.adapters.vllm._compat import block_pool_kwargs, require_supported_vllm

require_supported_vllm()

from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import (  # noqa: E402
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    RSWAManager,
    SlidingWindowManager,
)

from .block_pool import GuardedBlockPool, GuardModeUnsupported  # noqa: E402
from .config import GuardConfig, GuardConfigError  # noqa: E402
from .step_ledger import StepLedger  # noqa: E402

GUARDED_MANAGERS = (
    FullAttentionManager,
    SlidingWindowManager,
    ChunkedLocalAttentionManager,
    RSWAManager,
)
"""vLLM's single-type managers guarded mode supports, by exact type (others, such as
circular-buffer, sink or Mamba managers, write, copy or ring-reuse blocks in ways not
covered). The windowed ones free blocks below a running request's processed tokens
(``remove_skipped_blocks``), which the guarded schedulers validate as they go."""


def install_guarded_pool(
    manager: Any,
    guard: GuardConfig,
    *,
    ledger: StepLedger | None = None,
    window_frees: Callable[[list[int]], bool | None] | None = None,
) -> GuardedBlockPool:
    """Replace ``manager``'s block pool by a :class:`GuardedBlockPool` (fresh manager
    only; a guard that is on -- with it off, vLLM's own pool stays). ``ledger`` and
    ``window_frees``: see :class:`GuardedBlockPool`."""
    if not guard.enabled:
        raise GuardConfigError(
            "install_guarded_pool() with the guard off: pass-through keeps vLLM's own pool"
        )
    old = manager.block_pool
    if isinstance(old, GuardedBlockPool):
        raise RuntimeError("this KVCacheManager already runs on a GuardedBlockPool")
    if old.get_num_free_blocks() != old.num_gpu_blocks - 1:
        raise RuntimeError(
            "install_guarded_pool() needs a KVCacheManager that has not handed out blocks"
        )
    coordinator = manager.coordinator
    managers = coordinator.single_type_managers
    unsupported = [type(m).__name__ for m in managers if type(m) not in GUARDED_MANAGERS]
    if unsupported:
        raise GuardModeUnsupported(
            "kvguard's guarded pool supports full-attention, sliding-window, "
            "chunked-local and R-SWA KV cache groups only; this model also has "
            f"{sorted(set(unsupported))}. Set KVGUARD_GUARD=0 (pass-through) for it."
        )
    if coordinator.enable_partial_hash_hits:
        raise GuardModeUnsupported(
            "kvguard's guarded pool does not support partial-block prefix hits "
            "(hash_block_size < block_size)"
        )
    pool = GuardedBlockPool(
        **block_pool_kwargs(old), guard=guard, ledger=ledger, window_frees=window_frees
    )
    coordinator.block_pool = pool
    manager.block_pool = pool
    for single in managers:
        single.block_pool = pool
        single._null_block = pool.null_block
    return pool


def build_kv_cache_manager(*, guard: GuardConfig | None = None, **kwargs: Any) -> Any:
    """``KVCacheManager(**kwargs)`` running on kvguard's pool, or on vLLM's own with the
    guard off (``guard`` defaults to the environment's settings, see
    :mod:`kvguard.adapters.vllm.config`). The blocks vLLM caches are noted in the pool's
    ledger (``block_pool.ledger.take_noted()``) for the caller to validate
    (``block_pool.validate_fills``).

    With a sliding-window, chunked-local or R-SWA group, the blocks vLLM frees while a
    request runs are released without knowing whether their steps passed (the guarded
    schedulers know): unvalidated ones are quarantined, and must not be named in a
    later ``validate_fills``."""
    manager = KVCacheManager(**kwargs)
    guard = guard if guard is not None else GuardConfig.from_env()
    if guard.enabled:
        install_guarded_pool(manager, guard)
    return manager
