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
    CircularBufferManager,
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    RSWAManager,
    SlidingWindowManager,
)

from kvguard.adapters.vllm.config import GuardConfig, GuardConfigError  # noqa: E402
from kvguard.adapters.vllm.pool.block_pool import GuardedBlockPool, GuardModeUnsupported  # noqa: E402

GUARDED_MANAGERS = (
    FullAttentionManager,
    SlidingWindowManager,
    ChunkedLocalAttentionManager,
    RSWAManager,
    CrossAttentionManager,
    CircularBufferManager,
    MambaManager,
)
"""vLLM's single-type managers guarded mode supports, by exact type. The windowed ones
free blocks below a running request's processed tokens (``remove_skipped_blocks``),
which the guarded schedulers validate as they go. A cross-attention group's blocks
(encoder-decoder models, which vLLM runs without prefix caching) hold the encoder's KV,
written by the step that runs the encoder; a circular buffer is one block per request
rewritten in place, never prefix cached: neither is ever published. Like every block no
step validated, theirs are freed plainly when their request leaves after a clean step,
and quarantined (zeroed before reuse) when it fails.

A Mamba group (hybrid models: Mamba, Mamba2 or gated-delta-net layers beside attention)
holds per request the running state block, overwritten in place by every step, and, in
vLLM's ``align`` mode (prefix caching), the state at each block boundary in a block of
its own: vLLM caches that block while it schedules the step that computes the boundary,
so the guard holds its key back until that step validated, as for attention blocks. A
checkpoint vLLM re-keys or takes back (``cache_partial_block``,
``_maybe_evict_cached_block``) loses the key held for it; an entry inside a block waits
until nothing changes what it covers (see ``GuardedBlockPool.cache_partial_block``)."""

_RUN_UNGUARDED = (
    "Run this model without the guard (KVGUARD_GUARD=0, or --additional-config "
    """'{"kvguard": {"enabled": false}}'): vLLM's own KV cache, unguarded. """
    "docs/vllm-reference.md lists the KV cache groups the guard covers."
)

REFUSED_MANAGERS: dict[str, str] = {
    "SinkFullAttentionManager": (
        "static sink tokens: vLLM 0.32-0.34 cannot build this group (the manager's "
        "constructor rejects the coordinator's arguments, so the engine fails to start, "
        "unguarded too), and the worker writes the sink KV into blocks 1..N that vLLM's "
        "pool never reserves, which kvguard would hand out and zero like any other"
    ),
    "HiSparseSourceManager": (
        "HiSparse keeps this group's KV in a host-memory pool of its own, which kvguard's "
        "pool would replace, and publishes its blocks once the host copy is durable"
    ),
    "HiSparseHotManager": (
        "HiSparse's hot region reads KV the HiSparse host pool holds, which kvguard does not guard"
    ),
    "HiSparseResidentManager": (
        "HiSparse re-points a request's block table at GPU copies of host pages "
        "(residency changes), which kvguard does not track"
    ),
}
"""vLLM's single-type managers guarded mode refuses, by class name (a series may lack
some), each with why: the start-up error names the group type and says what to do."""


def group_refusal(manager_type: type) -> str | None:
    """Why guarded mode refuses a KV cache group run by vLLM's ``manager_type``, or None
    when it guards it. A manager kvguard has not decided on (a new vLLM group type) is
    refused: guarding it takes knowing how it writes, shares and frees its blocks."""
    if manager_type in GUARDED_MANAGERS:
        return None
    name = manager_type.__name__
    return REFUSED_MANAGERS.get(
        name,
        "a KV cache group type this kvguard does not know (newer than its vLLM adapter): "
        "how it writes, shares and frees blocks is unchecked",
    )


def refuse_unguarded_groups(managers: Any) -> None:
    """Raise :class:`GuardModeUnsupported` naming every group type of ``managers`` (a
    coordinator's single-type managers) guarded mode refuses, why, and what to do."""
    refused = {type(m).__name__: group_refusal(type(m)) for m in managers}
    reasons = [f"{name} groups: {why}" for name, why in sorted(refused.items()) if why]
    if reasons:
        raise GuardModeUnsupported(
            f"kvguard cannot guard this model's KV cache -- {'; '.join(reasons)}. {_RUN_UNGUARDED}"
        )


def _guarded_cow(pool: GuardedBlockPool, apply_cow: Callable[..., None]) -> Callable[..., None]:
    """vLLM's ``_apply_cow`` (a request hit an entry inside a block: it gets a private
    copy), which keeps the copy by writing ``ref_cnt += 1`` until the copy ran: that
    reference is the pool's to skip (:meth:`GuardedBlockPool.retain_for_copy`)."""

    def guarded_cow(request_id: str, block_idx: int, source_block: Any, cow_block: Any) -> None:
        apply_cow(request_id, block_idx, source_block, cow_block)
        pool.retain_for_copy(cow_block)

    return guarded_cow


def _guarded_mamba_allocation(pool: GuardedBlockPool, manager: Any) -> Callable[..., Any]:
    """The Mamba manager's ``allocate_new_blocks``, which, for a request whose prompt
    tail it copies (``move_block_hashes``), keeps the source block by writing its
    ``ref_cnt += 1`` until the copy ran: that reference is the pool's to skip too.
    (The source is still in the request's block table there, unlike in
    ``_apply_cow``, where the copy replaced it.)"""
    allocate = manager.allocate_new_blocks

    def allocate_new_blocks(request_id: str, *args: Any, **kwargs: Any) -> Any:
        before = len(manager._pending_cow_copies)
        blocks = allocate(request_id, *args, **kwargs)
        copies = manager._pending_cow_copies
        if len(copies) > before:  # (called for every request every step: most copy nothing)
            table = manager.req_to_blocks.get(request_id, ())
            for source, _ in copies[before:]:
                if any(block is source for block in table):
                    pool.retain_for_copy(source)
        return blocks

    return allocate_new_blocks


def install_guarded_pool(
    manager: Any,
    guard: GuardConfig,
    *,
    window_frees: Callable[[list[int]], bool | None] | None = None,
) -> GuardedBlockPool:
    """Replace ``manager``'s block pool by a :class:`GuardedBlockPool` (fresh manager
    only; a guard that is on -- with it off, vLLM's own pool stays). ``window_frees``:
    see :class:`GuardedBlockPool`."""
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
    refuse_unguarded_groups(managers)
    pool = GuardedBlockPool(**block_pool_kwargs(old), guard=guard, window_frees=window_frees)
    coordinator.block_pool = pool
    manager.block_pool = pool
    pool.state_groups = frozenset(
        single.kv_cache_group_id for single in managers if isinstance(single, MambaManager)
    )
    for single in managers:
        single.block_pool = pool
        single._null_block = pool.null_block
        single._apply_cow = _guarded_cow(pool, single._apply_cow)
        if isinstance(single, MambaManager):
            single.allocate_new_blocks = _guarded_mamba_allocation(pool, single)
    return pool


def build_kv_cache_manager(*, guard: GuardConfig | None = None, **kwargs: Any) -> Any:
    """``KVCacheManager(**kwargs)`` running on kvguard's pool, or on vLLM's own with the
    guard off (``guard`` defaults to the environment's settings, see
    :mod:`kvguard.adapters.vllm.config`). The blocks vLLM caches wait in the pool's
    outbox (``block_pool.take_cached()``) for the caller to validate
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
