"""A model runner's attention KV caches as kvguard layouts, in the scheduler's blocks.

Two views, each built once per runner and cached on it:

* :func:`slot_layouts`: for token-granular work (the slot wipe after ``recover()``).
  A token is addressed by its offset inside a block, which kvguard knows only for the
  layouts of :data:`LAYOUT_OF_BACKEND`; caches of :data:`REWRITTEN_NOT_WIPED` backends
  are left out.
* :func:`block_layouts`: for whole-block work (the KV audit). A whole block is the same
  bytes whatever their order inside it, so it also covers backends whose block
  interior kvguard cannot address (:data:`WHOLE_BLOCKS_ONLY`). Where a backend's
  kernel blocks are smaller than the scheduler's (vLLM splits them), the view merges
  each scheduler block's kernel blocks, so block ids are the scheduler's.

A cache of a backend kvguard does not know raises
:class:`~kvguard.adapters.vllm.pool.block_pool.GuardModeUnsupported` rather than being
skipped: a skipped layer would be neither wiped nor audited.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

LAYOUT_OF_BACKEND = {
    "FLASH_ATTN": "FLASH_ATTN",
    "FLASHINFER": "FLASHINFER",
    "FLASHMLA": "MLA",
    "TRITON_MLA": "MLA",
    "CUTLASS_MLA": "MLA",
    "FLASH_ATTN_MLA": "MLA",
}
"""vLLM attention backend name -> kvguard ``LayoutKind`` name of its KV cache."""

WHOLE_BLOCKS_ONLY = frozenset({"CPU_ATTN"})
"""Backends whose cache has the block dim first with a block's bytes contiguous, but
whose order of bytes inside a block kvguard cannot address: vLLM's CPU attention
(``[num_blocks, kv_heads, block_size, 2 * head_size]``) writes K and V through
ISA-specific ops (amx, vec, neon, ...)."""

REWRITTEN_NOT_WIPED = WHOLE_BLOCKS_ONLY
"""Backends whose caches the slot wipe leaves as they are: a token-granular wipe could
hit a validated token. The rolled-back slots are rewritten by the request's resumed step
before any query reads them (a step writes its tokens' KV before its attention reads
it, and no query reads past its own position)."""


def attention_caches(runner: Any) -> Iterator[tuple[str, str, Any]]:
    """``(layer name, backend name, cache tensor)`` of every attention layer."""
    import torch

    forward_context = runner.compilation_config.static_forward_context
    for groups in runner.attn_groups:
        for group in groups:
            backend = group.backend.get_name()
            for layer in group.layer_names:
                cache = getattr(forward_context.get(layer), "kv_cache", None)
                if isinstance(cache, torch.Tensor) and cache.numel():
                    yield layer, backend, cache


def slot_layouts(runner: Any) -> list[Any]:
    """The caches token slots can be wiped in, one layout per backend and geometry
    (one launch each); cached on the runner."""
    layouts = getattr(runner, "_kvguard_slot_layouts", None)
    if layouts is None:
        grouped: dict[tuple[Any, ...], list[Any]] = {}
        for layer, backend, cache in attention_caches(runner):
            if backend in REWRITTEN_NOT_WIPED:
                continue
            kind = _kind(layer, backend, "wipe token slots in")
            grouped.setdefault(_key(kind, cache), []).append(cache)
        layouts = runner._kvguard_slot_layouts = _layouts(grouped)
    return layouts


def block_layouts(runner: Any) -> list[Any]:
    """Every attention cache as whole blocks of the scheduler's block ids, one layout
    per geometry (one launch each); cached on the runner."""
    layouts = getattr(runner, "_kvguard_block_layouts", None)
    if layouts is None:
        caches = []
        for layer, backend, cache in attention_caches(runner):
            if backend in WHOLE_BLOCKS_ONLY:
                caches.append((layer, "", cache))
            else:
                caches.append((layer, _kind(layer, backend, "audit"), cache))
        num_blocks = runner.kv_cache_config.num_blocks
        layouts = runner._kvguard_block_layouts = whole_block_layouts(caches, num_blocks)
    return layouts


def whole_block_layouts(caches: Any, num_blocks: int) -> list[Any]:
    """``(layer, kind, cache)`` as whole scheduler blocks, one layout per geometry. An
    empty ``kind``: a cache with the block dim first and a block's bytes contiguous,
    whatever their order inside it (seen as ``[blocks, -1, last dim]``)."""
    grouped: dict[tuple[Any, ...], list[Any]] = {}
    for layer, kind, cache in caches:
        if not kind:
            kind, view, block_dim = "MLA", cache.view(cache.shape[0], -1, cache.shape[-1]), 0
        else:
            view, block_dim = cache, 1 if kind == "FLASH_ATTN" else 0
        view = _in_scheduler_blocks(layer, view, block_dim, num_blocks)
        grouped.setdefault(_key(kind, view), []).append(view)
    return _layouts(grouped)


def _kind(layer: str, backend: str, what: str) -> str:
    from kvguard.adapters.vllm.pool.block_pool import GuardModeUnsupported

    kind = LAYOUT_OF_BACKEND.get(backend)
    if kind is None:
        raise GuardModeUnsupported(
            f"kvguard cannot {what} layer {layer}'s KV cache: it does not know the "
            f"layout of attention backend {backend} (known: "
            f"{', '.join(sorted([*LAYOUT_OF_BACKEND, *WHOLE_BLOCKS_ONLY]))})"
        )
    return kind


def _in_scheduler_blocks(layer: str, cache: Any, block_dim: int, num_blocks: int) -> Any:
    """``cache`` with one index per scheduler block along ``block_dim`` (vLLM may split
    a scheduler block into several kernel blocks, laid out one after another)."""
    from kvguard.adapters.vllm.pool.block_pool import GuardModeUnsupported

    kernel_blocks = cache.shape[block_dim]
    if kernel_blocks == num_blocks:
        return cache
    ratio, rest = divmod(kernel_blocks, num_blocks)
    token_dim = block_dim + 1
    if rest or cache.stride(block_dim) != cache.shape[token_dim] * cache.stride(token_dim):
        raise GuardModeUnsupported(
            f"layer {layer}'s KV cache has {kernel_blocks} kernel blocks for the "
            f"scheduler's {num_blocks}, not laid out as whole scheduler blocks"
        )
    return cache.unflatten(block_dim, (num_blocks, ratio)).flatten(token_dim, token_dim + 1)


def _key(kind: str, cache: Any) -> tuple[Any, ...]:
    return (kind, tuple(cache.shape), cache.stride(), cache.dtype, cache.device)


def _layouts(grouped: dict[tuple[Any, ...], list[Any]]) -> list[Any]:
    from kvguard.kernels import KVCacheLayout, LayoutKind

    return [KVCacheLayout(caches, LayoutKind[key[0]]) for key, caches in grouped.items()]
