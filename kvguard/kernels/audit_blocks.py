"""Flag blocks whose KV holds a non-finite value in any layer (the optional KV audit).

Finite logits do not prove finite KV: a NaN written into a layer's KV can stay invisible
to this step's logits and poison the next request that hits the block. Before blocks are
published, the engine can audit them; a flagged block is invalidated instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvguard.kernels._addressing import NONFINITE_BITS, chunk_words
from kvguard.kernels.backend import (
    HAS_TRITON,
    Backend,
    default_max_programs,
    launch_grid,
    resolve_backend,
    tl,
    triton,
)
from kvguard.kernels.layout import KVCacheLayout, Region, checked_ids

__all__ = ["audit_blocks", "audit_blocks_ref"]

# Launch shape, measured on an H200 (docs/kernels.md, "Speed"): elements one item reads
# at most, warps per program, and software-pipeline stages.
ELEMENTS_PER_ITEM = 16384
NUM_WARPS = 8
NUM_STAGES = 1

if HAS_TRITON:
    from kvguard.kernels._addressing import TRITON_INT, split_item

    @triton.jit  # type: ignore[untyped-decorator]
    def _audit_blocks_kernel(
        table_ptr: tl.tensor,  # int64 [num_layers]: base address in bytes of each layer's cache
        ids_ptr: tl.tensor,  # int64 [num_ids]: block ids to audit (range-checked by the launcher)
        flags_ptr: tl.tensor,  # int32 [num_ids], zero-filled: set to 1 where a non-finite is found
        num_items: tl.tensor,  # num_ids * num_layers * size0 * size1 * size2 * num_chunks
        num_layers: tl.tensor,  # entries in table_ptr
        block_stride: tl.tensor,  # elements from block b to block b + 1 in a layer
        size0: tl.tensor,  # the block region's outer dims: sizes ...
        size1: tl.tensor,
        size2: tl.tensor,
        stride0: tl.tensor,  # ... and strides in elements (size 1 / stride 0 when unused)
        stride1: tl.tensor,
        stride2: tl.tensor,
        inner: tl.tensor,  # contiguous elements at each outer index
        num_chunks: tl.tensor,  # cdiv(inner, BLOCK)
        BITS: tl.constexpr,  # integer dtype as wide as one element: tests are on raw bits
        EXP_MASK: tl.constexpr,  # exponent bits: all set <=> NaN or +-Inf
        BLOCK: tl.constexpr,  # elements one item scans (power of two)
    ) -> None:
        pid = tl.program_id(0).to(tl.int64)
        num_programs = tl.num_programs(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        # Items, not blocks, are spread over programs so that auditing a handful of
        # blocks still uses the whole GPU; the flag is merged with an atomic, issued only
        # by items that found something (clean caches do no atomics).
        for item in range(pid, num_items, num_programs):
            idx, layer, o0, o1, o2, chunk = split_item(
                item, num_layers, size0, size1, size2, num_chunks
            )
            base = tl.load(table_ptr + layer).to(tl.pointer_type(BITS))
            block = tl.load(ids_ptr + idx).to(tl.int64)
            elem = chunk * BLOCK + offs
            offset = block * block_stride + o0 * stride0 + o1 * stride1 + o2 * stride2 + elem
            bits = tl.load(base + offset, mask=elem < inner, other=0)
            found = tl.max(((bits & EXP_MASK) == EXP_MASK).to(tl.int32), axis=0)
            tl.atomic_max(flags_ptr + idx, found, mask=found > 0)


def audit_blocks_ref(layout: KVCacheLayout, block_ids: torch.Tensor) -> torch.Tensor:
    """Pure-torch audit (test oracle and fallback): bool ``[num_ids]``.

    ``block_ids``: int64 ``[num_ids]`` on the cache's device, already range-checked.
    """
    flags = torch.zeros(block_ids.numel(), dtype=torch.bool, device=layout.device)
    dim = layout.kind.block_dim
    for cache in layout.caches:
        picked = cache.index_select(dim, block_ids).movedim(dim, 0).flatten(1)
        if picked.element_size() == 1:  # float8 has no isfinite kernel on every build
            picked = picked.float()
        # A block's sum is NaN or infinite wherever one of its values is (NaN spreads,
        # inf + -inf is NaN), so only blocks whose sum is not finite are checked value
        # by value (a sum can also overflow): on a clean cache, one pass instead of
        # isfinite's several (7x faster on CPU, where this is the audit's path).
        suspect = ~torch.isfinite(picked.sum(dim=1, dtype=torch.float32))
        if bool(suspect.any()):
            suspect[suspect.clone()] = ~torch.isfinite(picked[suspect]).all(dim=1)
        flags |= suspect
    return flags


def _launch_audit_blocks(
    table: torch.Tensor,
    ids: torch.Tensor,
    flags: torch.Tensor,
    region: Region,
    block_stride: int,
    dtype: torch.dtype,
    max_programs: int,
) -> None:
    """Launch the kernel; ``region`` and ``block_stride`` count elements of ``dtype``."""
    block = chunk_words(region.inner, cap=ELEMENTS_PER_ITEM)
    num_chunks = -(-region.inner // block)
    (s0, t0), (s1, t1), (s2, t2) = region.outer
    num_items = ids.numel() * table.numel() * s0 * s1 * s2 * num_chunks
    _audit_blocks_kernel[launch_grid(num_items, max_programs)](
        table,
        ids,
        flags,
        num_items,
        table.numel(),
        block_stride,
        s0,
        s1,
        s2,
        t0,
        t1,
        t2,
        region.inner,
        num_chunks,
        BITS=TRITON_INT[dtype.itemsize],
        EXP_MASK=NONFINITE_BITS[dtype][0],
        BLOCK=block,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )


def audit_blocks(
    layout: KVCacheLayout,
    block_ids: Sequence[int] | torch.Tensor,
    *,
    backend: Backend = "auto",
    max_programs: int | None = None,
) -> torch.Tensor:
    """Per block, whether any layer holds NaN or ±Inf in it: bool ``[num_ids]``.

    ``block_ids``: ints or an int32/int64 tensor ``[num_ids]``, each in
    ``[0, layout.num_blocks)`` (:class:`~kvguard.kernels.layout.LayoutError` before any
    launch otherwise); duplicates get the same flag; empty gives an empty result. The
    result stays on the cache's device (two launches: a zero fill and the scan).
    """
    ids = checked_ids(block_ids, layout.num_blocks, layout.device, "block id")
    if ids.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=layout.device)
    if resolve_backend(backend, layout.device) == "torch":
        return audit_blocks_ref(layout, ids)
    item = layout.dtype.itemsize
    flags = torch.zeros(ids.numel(), dtype=torch.int32, device=layout.device)
    _launch_audit_blocks(
        layout.address_table,
        ids,
        flags,
        layout.block_region.in_words(item),
        layout.block_stride_bytes // item,
        layout.dtype,
        max_programs or default_max_programs(layout.device),
    )
    return flags != 0
