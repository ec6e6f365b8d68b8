"""Zero whole KV blocks in every layer with one launch (zero-on-reuse).

The pool's ``take_blocks_to_zero()`` lists blocks that may hold unvalidated or corrupt
KV; they are zeroed before the next step can read them. Zeroing stores zero *bits* in the
widest word the layout allows (all-zero bits are +0.0 in every supported float format),
so one kernel serves fp32, fp16, bf16 and float8 alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvguard.kernels._addressing import INT_VIEW, chunk_words, int_view
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

__all__ = ["zero_blocks", "zero_blocks_ref"]

# Launch shape, measured on an H200 (docs/kernels.md, "Speed"): words one item stores at
# most, warps per program, software-pipeline stages, and the stores' L2 eviction policy.
WORDS_PER_ITEM = 4096
NUM_WARPS = 4
NUM_STAGES = 3
EVICTION = ""

if HAS_TRITON:
    from kvguard.kernels._addressing import TRITON_INT, split_item

    @triton.jit  # type: ignore[untyped-decorator]
    def _zero_blocks_kernel(
        table_ptr: tl.tensor,  # int64 [num_layers]: base address in bytes of each layer's cache
        ids_ptr: tl.tensor,  # int64 [num_ids]: block ids to zero (checked in range by the launcher)
        num_items: tl.tensor,  # num_ids * num_layers * size0 * size1 * size2 * num_chunks
        num_layers: tl.tensor,  # entries in table_ptr
        block_stride: tl.tensor,  # words from block b to b + 1 in a layer (same in all layers)
        size0: tl.tensor,  # the block region's outer dims: sizes ...
        size1: tl.tensor,
        size2: tl.tensor,
        stride0: tl.tensor,  # ... and strides in words (size 1 / stride 0 when unused)
        stride1: tl.tensor,
        stride2: tl.tensor,
        inner: tl.tensor,  # contiguous words at each outer index
        num_chunks: tl.tensor,  # cdiv(inner, BLOCK)
        WORD: tl.constexpr,  # integer dtype one word wide: zeros are stored as raw bits
        BLOCK: tl.constexpr,  # words one item stores (power of two)
        EVICTION: tl.constexpr,  # L2 eviction policy of the stores ("" = default)
    ) -> None:
        pid = tl.program_id(0).to(tl.int64)
        num_programs = tl.num_programs(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        zeros = tl.zeros([BLOCK], dtype=WORD)
        # Grid-stride loop: the grid is capped (launch_grid), so millions of blocks never
        # overflow a grid dimension; each program walks items pid, pid + P, ...
        for item in range(pid, num_items, num_programs):
            idx, layer, o0, o1, o2, chunk = split_item(
                item, num_layers, size0, size1, size2, num_chunks
            )
            base = tl.load(table_ptr + layer).to(tl.pointer_type(WORD))
            block = tl.load(ids_ptr + idx).to(tl.int64)
            word = chunk * BLOCK + offs
            # int64 throughout: block * block_stride passes 2**31 words in large caches.
            offset = block * block_stride + o0 * stride0 + o1 * stride1 + o2 * stride2 + word
            tl.store(base + offset, zeros, mask=word < inner, eviction_policy=EVICTION)


def zero_blocks_ref(layout: KVCacheLayout, block_ids: torch.Tensor) -> None:
    """Pure-torch zero_blocks: the test oracle and the CPU fallback.

    ``block_ids``: int64 ``[num_ids]`` on the cache's device, already range-checked.
    """
    for cache in layout.caches:
        # 0.0 is all-zero bits in every supported dtype; float8 has no index_fill_ kernel
        # on every build, so it goes through its integer view (same bytes).
        target = int_view(cache) if cache.element_size() == 1 else cache
        target.index_fill_(layout.kind.block_dim, block_ids, 0)


def _launch_zero_blocks(
    table: torch.Tensor,
    ids: torch.Tensor,
    region: Region,
    block_stride: int,
    word_bytes: int,
    max_programs: int,
) -> None:
    """Launch the kernel for a region already counted in ``word_bytes``-wide words."""
    block = chunk_words(region.inner, cap=WORDS_PER_ITEM)
    num_chunks = -(-region.inner // block)
    (s0, t0), (s1, t1), (s2, t2) = region.outer
    num_items = ids.numel() * table.numel() * s0 * s1 * s2 * num_chunks
    word = TRITON_INT[word_bytes]
    _zero_blocks_kernel[launch_grid(num_items, max_programs)](
        table,
        ids,
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
        WORD=word,
        BLOCK=block,
        EVICTION=EVICTION,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )


def zero_blocks(
    layout: KVCacheLayout,
    block_ids: Sequence[int] | torch.Tensor,
    *,
    backend: Backend = "auto",
    max_programs: int | None = None,
) -> None:
    """Zero every byte of ``block_ids`` in every layer of ``layout``, in one launch.

    ``block_ids``: ints or an int32/int64 tensor ``[num_ids]``; duplicates are harmless,
    an empty list launches nothing. Every id must be in ``[0, layout.num_blocks)``
    (:class:`~kvguard.kernels.layout.LayoutError` otherwise, raised before any write).
    Neighbouring blocks — including the other half of a packed K/V pair — are never
    written. ``max_programs`` caps the grid (default: 16 per SM on CUDA); the kernel loops
    over whatever the grid does not cover.

    Asynchronous on CUDA: the zeros land in stream order before later work on the stream.
    """
    ids = checked_ids(block_ids, layout.num_blocks, layout.device, "block id")
    if ids.numel() == 0:
        return
    if resolve_backend(backend, layout.device) == "torch":
        zero_blocks_ref(layout, ids)
        return
    region = layout.block_region
    word_bytes = layout.word_bytes(region, layout.block_stride_bytes)
    assert word_bytes in INT_VIEW, word_bytes
    _launch_zero_blocks(
        layout.address_table,
        ids,
        region.in_words(word_bytes),
        layout.block_stride_bytes // word_bytes,
        word_bytes,
        max_programs or default_max_programs(layout.device),
    )
