"""Seal blocks: a 64-bit fingerprint of each block's KV across every layer.

A seal is taken of exactly the KV a step's validation vouched for, so that a copy of the
block -- in a CPU or disk tier, in shared storage, sent to another instance -- can be
checked against it when it is loaded: a copy whose seal verifies holds the validated
bytes; one that rotted, was truncated, filed under another prefix, or written by another
model, dtype, block size or layout does not.

The function (docs/design.md, "Seals"): every element ``e`` of the block -- each layer's
K and V, in the layout's memory order -- is read as its raw bits ``x_e`` (zero-extended)
at its position ``p_e`` (counted across the block's layers, layer 0 first), and

    seal = sum over e of fmix64((p_e << 32 | x_e) ^ salt)   (mod 2**64)

``fmix64`` is MurmurHash3's 64-bit finaliser, a bijection: distinct (position, bits)
pairs give distinct terms, so a changed word, two words swapped, a word moved, a NaN
with another payload (bits, not float comparisons) all change the multiset of terms,
and a sum of well-mixed 64-bit terms misses such a change with a chance near 2**-64
(a plain sum misses swaps and compensating words; a CRC would serialise the block).
The sum is order-free, so the work splits over any number of programs and merges with
one atomic add each. ``salt`` binds the seal to what must also match (a model, dtype
and layout tag chosen by the caller); a copy sealed under another salt never verifies.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from kvguard.kernels._addressing import chunk_words, int_view
from kvguard.kernels.backend import (
    HAS_TRITON,
    Backend,
    default_max_programs,
    launch_grid,
    resolve_backend,
    tl,
    triton,
)
from kvguard.kernels.layout import KVCacheLayout, LayoutError, checked_ids

__all__ = ["fmix64", "seal_blocks", "seal_blocks_ref"]

# Launch shape: elements one item reads at most, warps per program, pipeline stages.
# (Not measured on a GPU yet: .ci/gpu-check times it against a copy of the same bytes.)
ELEMENTS_PER_ITEM = 4096
NUM_WARPS = 8
NUM_STAGES = 1

_M64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    return value - (1 << 64) if value >> 63 else value


# MurmurHash3's fmix64 multipliers, as int64 (wrapping multiplication is the same for
# signed and unsigned 64-bit words).
FMIX_C1 = _signed(0xFF51AFD7ED558CCD)
FMIX_C2 = _signed(0xC4CEB9FE1A85EC53)
# A logical right shift by 33 on an int64: the arithmetic shift, its sign copies masked.
SHIFT_MASK = (1 << 31) - 1


def fmix64(value: int) -> int:
    """MurmurHash3's 64-bit finaliser on a Python int (the seal's mixing, for oracles)."""
    k = value & _M64
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & _M64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & _M64
    k ^= k >> 33
    return k


if HAS_TRITON:
    from kvguard.kernels._addressing import TRITON_INT, split_item

    @triton.jit  # type: ignore[untyped-decorator]
    def _seal_blocks_kernel(
        table_ptr: tl.tensor,  # int64 [num_layers]: base address in bytes of each layer's cache
        ids_ptr: tl.tensor,  # int64 [num_ids]: block ids to seal (range-checked by the launcher)
        seals_ptr: tl.tensor,  # int64 [num_ids], zero-filled: each block's sum of terms
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
        salt: tl.tensor,  # int64 xor-ed into every key
        BITS: tl.constexpr,  # integer dtype as wide as one element: the seal reads raw bits
        VALUE_MASK: tl.constexpr,  # 2**(8 * element size) - 1: zero-extends the bits
        C1: tl.constexpr,
        C2: tl.constexpr,
        LOW31: tl.constexpr,  # (1 << 31) - 1: a logical shift by 33 from an arithmetic one
        BLOCK: tl.constexpr,  # elements one item reads (power of two)
    ) -> None:
        pid = tl.program_id(0).to(tl.int64)
        num_programs = tl.num_programs(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        for item in range(pid, num_items, num_programs):
            idx, layer, o0, o1, o2, chunk = split_item(
                item, num_layers, size0, size1, size2, num_chunks
            )
            base = tl.load(table_ptr + layer).to(tl.pointer_type(BITS))
            block = tl.load(ids_ptr + idx).to(tl.int64)
            elem = chunk * BLOCK + offs
            valid = elem < inner
            offset = block * block_stride + o0 * stride0 + o1 * stride1 + o2 * stride2 + elem
            bits = tl.load(base + offset, mask=valid, other=0).to(tl.int64) & VALUE_MASK
            position = (((layer * size0 + o0) * size1 + o1) * size2 + o2) * inner + elem
            # (Cast: the interpreter may carry these indices as int32, whose << 32 is 0.)
            k = ((position.to(tl.int64) << 32) | bits) ^ salt
            k = k ^ ((k >> 33) & LOW31)
            k = k * C1
            k = k ^ ((k >> 33) & LOW31)
            k = k * C2
            k = k ^ ((k >> 33) & LOW31)
            partial = tl.sum(tl.where(valid, k, 0), axis=0)
            tl.atomic_add(seals_ptr + idx, partial)


def seal_blocks_ref(layout: KVCacheLayout, block_ids: torch.Tensor, salt: int = 0) -> torch.Tensor:
    """Pure-torch seals (test oracle and the CPU path): int64 ``[num_ids]``.

    ``block_ids``: int64 ``[num_ids]`` on the cache's device, already range-checked.
    Reads each block in the kernel's order (the layout's block region, outermost stride
    first), so both give the same seal bit for bit. Every layer's blocks are gathered
    side by side first and mixed in one pass, in place: on a CPU the cost is the number
    of tensor operations more than the bytes (a decode step seals a block or two).
    """
    item = layout.dtype.itemsize
    region = layout.block_region.in_words(item)
    (s0, t0), (s1, t1), (s2, t2) = region.outer
    inner = region.inner
    numel = s0 * s1 * s2 * inner
    block_stride = layout.block_stride_bytes // item
    gathered = []
    for cache in layout.caches:
        bits = int_view(cache)
        blocks = torch.as_strided(
            bits,
            (layout.num_blocks, s0, s1, s2, inner),
            (block_stride, t0, t1, t2, 1),
            bits.storage_offset(),
        )
        gathered.append(blocks.index_select(0, block_ids).reshape(block_ids.numel(), numel))
    # [num_ids, layers * numel]: the raw bits, zero-extended (read as unsigned).
    keys = torch.cat(gathered, dim=1).view(_UNSIGNED[item]).to(torch.int64)
    keys ^= _salted_positions(keys.shape[1], salt, keys.device)  # (p << 32 | x) ^ salt
    shifted = torch.empty_like(keys)
    for multiplier in (FMIX_C1, FMIX_C2, None):  # fmix64, in place
        torch.bitwise_right_shift(keys, 33, out=shifted)
        shifted &= SHIFT_MASK
        keys ^= shifted
        if multiplier is not None:
            keys *= multiplier
    return keys.sum(dim=1)


_UNSIGNED = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32}
"""The unsigned integer type of each word size (a word's bits, zero-extended to int64)."""


@functools.lru_cache(maxsize=8)
def _salted_positions(count: int, salt: int, device: torch.device) -> torch.Tensor:
    """``(p << 32) ^ salt`` for positions ``0 .. count - 1``: the bits of a term that do
    not depend on the block (its value fills the low 32 bits, zero here)."""
    positions = torch.arange(count, dtype=torch.int64, device=device) << 32
    return positions ^ _signed(salt & _M64)


def _launch_seal_blocks(
    layout: KVCacheLayout, ids: torch.Tensor, seals: torch.Tensor, salt: int, max_programs: int
) -> None:
    item = layout.dtype.itemsize
    region = layout.block_region.in_words(item)
    block = chunk_words(region.inner, cap=ELEMENTS_PER_ITEM)
    num_chunks = -(-region.inner // block)
    (s0, t0), (s1, t1), (s2, t2) = region.outer
    table = layout.address_table
    num_items = ids.numel() * table.numel() * s0 * s1 * s2 * num_chunks
    _seal_blocks_kernel[launch_grid(num_items, max_programs)](
        table,
        ids,
        seals,
        num_items,
        table.numel(),
        layout.block_stride_bytes // item,
        s0,
        s1,
        s2,
        t0,
        t1,
        t2,
        region.inner,
        num_chunks,
        _signed(salt & _M64),
        BITS=TRITON_INT[item],
        VALUE_MASK=(1 << (8 * item)) - 1,
        C1=FMIX_C1,
        C2=FMIX_C2,
        LOW31=SHIFT_MASK,
        BLOCK=block,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )


def seal_blocks(
    layout: KVCacheLayout,
    block_ids: Sequence[int] | torch.Tensor,
    *,
    salt: int = 0,
    backend: Backend = "auto",
    max_programs: int | None = None,
) -> torch.Tensor:
    """Each block's seal over every layer: int64 ``[num_ids]`` (see the module doc).

    ``block_ids``: ints or an int32/int64 tensor ``[num_ids]``, each in
    ``[0, layout.num_blocks)`` (:class:`~kvguard.kernels.layout.LayoutError` before any
    launch otherwise); duplicates get the same seal; empty gives an empty result.
    ``salt``: an int (taken mod 2**64) that every seal depends on. The result stays on
    the cache's device (two launches: a zero fill and the pass, each byte read once).
    """
    if type(salt) is not int:
        raise LayoutError(f"salt must be an int, got {type(salt).__name__}")
    ids = checked_ids(block_ids, layout.num_blocks, layout.device, "block id")
    if layout.bytes_per_block // layout.dtype.itemsize >= 1 << 32:
        raise LayoutError(
            f"a block holds {layout.bytes_per_block} bytes across its layers: seals number "
            "its elements in 32 bits"
        )
    if ids.numel() == 0:
        return torch.zeros(0, dtype=torch.int64, device=layout.device)
    if resolve_backend(backend, layout.device) == "torch":
        return seal_blocks_ref(layout, ids, salt)
    seals = torch.zeros(ids.numel(), dtype=torch.int64, device=layout.device)
    _launch_seal_blocks(
        layout, ids, seals, salt, max_programs or default_max_programs(layout.device)
    )
    return seals
