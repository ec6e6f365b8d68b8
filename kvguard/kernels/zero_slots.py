"""Zero individual token slots in every layer with one launch (token-granular wipe).

Used by ``zero_request_tail``: the KV of a request's last tokens is wiped while the valid
prefix of the same (partial) block is kept. A slot is ``block_id * block_size + offset``;
the pool describes slots as :class:`~kvguard.results.SlotRange` ``[start, end)`` runs
inside one block::

    block 7, block_size 8, SlotRange(7, 5, 8)
    | t0 t1 t2 t3 t4 | t5 t6 t7 |
      kept (valid)     wiped -> slots 61, 62, 63
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
from kvguard.kernels.layout import KVCacheLayout, LayoutError, LayoutKind, Region, checked_ids
from kvguard.results import SlotRange

__all__ = ["slot_ids", "zero_slots", "zero_slots_ref"]

if HAS_TRITON:
    from kvguard.kernels._addressing import TRITON_INT, split_item

    @triton.jit  # type: ignore[untyped-decorator]
    def _zero_slots_kernel(
        table_ptr: tl.tensor,  # int64 [num_layers]: base address in bytes of each layer's cache
        slots_ptr: tl.tensor,  # int64 [num_slots]: slot ids, block_id * block_size + offset
        num_items: tl.tensor,  # num_slots * num_layers * size0 * size1 * size2 * num_chunks
        num_layers: tl.tensor,  # entries in table_ptr
        block_size: tl.tensor,  # tokens per block: splits a slot id into (block, offset)
        block_stride: tl.tensor,  # words from block b to block b + 1
        token_stride: tl.tensor,  # words from token t to token t + 1 inside a block
        size0: tl.tensor,  # the slot region's outer dims (K/V, heads, ...): sizes ...
        size1: tl.tensor,
        size2: tl.tensor,
        stride0: tl.tensor,  # ... and strides in words (size 1 / stride 0 when unused)
        stride1: tl.tensor,
        stride2: tl.tensor,
        inner: tl.tensor,  # contiguous words at each outer index
        num_chunks: tl.tensor,  # cdiv(inner, BLOCK)
        WORD: tl.constexpr,  # integer dtype one word wide: zeros are stored as raw bits
        BLOCK: tl.constexpr,  # words one item stores (power of two)
    ) -> None:
        pid = tl.program_id(0).to(tl.int64)
        num_programs = tl.num_programs(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        zeros = tl.zeros([BLOCK], dtype=WORD)
        for item in range(pid, num_items, num_programs):  # grid-stride: capped grid
            idx, layer, o0, o1, o2, chunk = split_item(
                item, num_layers, size0, size1, size2, num_chunks
            )
            base = tl.load(table_ptr + layer).to(tl.pointer_type(WORD))
            slot = tl.load(slots_ptr + idx).to(tl.int64)
            block = slot // block_size
            token = slot % block_size
            word = chunk * BLOCK + offs
            offset = (
                block * block_stride
                + token * token_stride
                + o0 * stride0
                + o1 * stride1
                + o2 * stride2
                + word
            )
            tl.store(base + offset, zeros, mask=word < inner)


def slot_ids(layout: KVCacheLayout, slots: Sequence[SlotRange]) -> list[int]:
    """Flatten ``SlotRange`` runs into slot ids, checking each against the layout."""
    out: list[int] = []
    for r in slots:
        if not (0 <= r.start <= r.end <= layout.block_size):
            raise LayoutError(
                f"{r} does not fit a block of {layout.block_size} tokens "
                "(need 0 <= start <= end <= block_size)"
            )
        if not 0 <= r.block_id < layout.num_blocks:
            raise LayoutError(
                f"{r}: block {r.block_id} is outside the cache's blocks [0, {layout.num_blocks})"
            )
        first = r.block_id * layout.block_size
        out.extend(range(first + r.start, first + r.end))
    return out


def zero_slots_ref(layout: KVCacheLayout, slots: torch.Tensor) -> None:
    """Pure-torch zero_slots: the test oracle and the CPU fallback.

    ``slots``: int64 ``[num_slots]`` slot ids on the cache's device, range-checked.
    """
    blocks = slots // layout.block_size
    tokens = slots % layout.block_size
    for cache in layout.caches:
        view = int_view(cache)  # integer view: float8 index_put works on every build
        if layout.kind is LayoutKind.FLASH_ATTN:
            view[:, blocks, tokens] = 0
        elif layout.kind is LayoutKind.FLASHINFER:
            view[blocks, :, tokens] = 0
        else:
            view[blocks, tokens] = 0


def _launch_zero_slots(
    table: torch.Tensor,
    slots: torch.Tensor,
    region: Region,
    block_size: int,
    block_stride: int,
    token_stride: int,
    word_bytes: int,
    max_programs: int,
) -> None:
    """Launch the kernel; ``region`` and strides are already in ``word_bytes`` words."""
    block = chunk_words(region.inner)
    num_chunks = -(-region.inner // block)
    (s0, t0), (s1, t1), (s2, t2) = region.outer
    num_items = slots.numel() * table.numel() * s0 * s1 * s2 * num_chunks
    _zero_slots_kernel[launch_grid(num_items, max_programs)](
        table,
        slots,
        num_items,
        table.numel(),
        block_size,
        block_stride,
        token_stride,
        s0,
        s1,
        s2,
        t0,
        t1,
        t2,
        region.inner,
        num_chunks,
        WORD=TRITON_INT[word_bytes],
        BLOCK=block,
    )


def zero_slots(
    layout: KVCacheLayout,
    slots: Sequence[SlotRange] | torch.Tensor,
    *,
    backend: Backend = "auto",
    max_programs: int | None = None,
) -> int:
    """Zero the given token slots in every layer of ``layout``, in one launch.

    ``slots``: the pool's ``SlotRange`` objects, or an int32/int64 tensor ``[num_slots]``
    of slot ids ``block_id * block_size + offset``. K and V of each slot are zeroed and
    nothing else: the other slots of the block (its valid prefix) keep every byte.
    Duplicates are harmless; an empty input launches nothing. Out-of-range slots raise
    :class:`~kvguard.kernels.layout.LayoutError` before any write. Returns the number
    of slots wiped (duplicates counted).
    """
    limit = layout.num_blocks * layout.block_size
    if isinstance(slots, torch.Tensor):
        ids = checked_ids(slots, limit, layout.device, "slot id")
    else:
        ids = checked_ids(slot_ids(layout, slots), limit, layout.device, "slot id")
    if ids.numel() == 0:
        return 0
    if resolve_backend(backend, layout.device) == "torch":
        zero_slots_ref(layout, ids)
        return ids.numel()
    region = layout.token_region
    word_bytes = layout.word_bytes(region, layout.block_stride_bytes, layout.token_stride_bytes)
    assert word_bytes in INT_VIEW, word_bytes
    _launch_zero_slots(
        layout.address_table,
        ids,
        region.in_words(word_bytes),
        layout.block_size,
        layout.block_stride_bytes // word_bytes,
        layout.token_stride_bytes // word_bytes,
        word_bytes,
        max_programs or default_max_programs(layout.device),
    )
    return ids.numel()
