"""Shared pieces of the cache kernels: work-item decomposition and raw-bits dtypes.

Kernels that walk KV memory (zero blocks, zero slots, audit) split their work into items
``(id, layer, outer0, outer1, outer2, chunk)``, flattened into one int64 counter that a
grid-stride loop walks. The id is outermost so that neighbouring programs touch
neighbouring bytes of the same block. All arithmetic is int64: ``block_id * block_stride``
alone exceeds 2**31 bytes for caches of a few GiB.
"""

from __future__ import annotations

import torch

# tl looks unused, but the Triton interpreter finds triton.language through a jit
# function's module globals, so it must be imported here.
from kvguard.kernels.backend import HAS_TRITON, tl, triton

__all__ = ["INT_VIEW", "NONFINITE_BITS", "chunk_words", "int_view"]

# Same-width integer dtype per element size: zeroing and finiteness tests work on raw
# bits, which makes them dtype-agnostic (float8 included) and exact.
INT_VIEW: dict[int, torch.dtype] = {
    1: torch.int8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}

# dtype -> (exponent mask, mantissa mask) of its bit pattern. A value is non-finite when
# all exponent bits are set; NaN when additionally a mantissa bit is set. float8_e4m3fn
# has no infinity and a single NaN pattern (S.1111.111), hence both masks 0x7F.
NONFINITE_BITS: dict[torch.dtype, tuple[int, int]] = {
    torch.float32: (0x7F800000, 0x007FFFFF),
    torch.float16: (0x7C00, 0x03FF),
    torch.bfloat16: (0x7F80, 0x007F),
    torch.float8_e4m3fn: (0x7F, 0x7F),
    torch.float8_e5m2: (0x7C, 0x03),
}


def int_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` reinterpreted as same-width integers (no copy, same strides)."""
    return tensor.view(INT_VIEW[tensor.element_size()])


# Below this many words an item's fixed cost outweighs its padding: short runs take one
# item, rounded up to a power of two.
MIN_CHUNK = 256


def chunk_words(inner: int, cap: int = 1024) -> int:
    """Words one work item handles: a power of two, at most ``cap``.

    Wide items amortise each item's index arithmetic and its two dependent loads (the
    layer's base address, the block id) over more bytes; but lanes past the end of a run
    are masked off and still cost issue slots. So: the widest power of two (up to ``cap``)
    whose padding wastes at most 1/8 of the run, but never narrower than ``MIN_CHUNK``
    on that account. A 2,304-word MLA run takes 512-word items (2,560 words, 10% padding)
    rather than one of 4,096 (44%).
    """
    width = min(triton_next_pow2(inner), cap)
    while width > MIN_CHUNK and (-(-inner // width) * width - inner) * 8 > inner:
        width //= 2
    return width


def triton_next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


if HAS_TRITON:
    # The Triton twin of INT_VIEW, for the kernels' WORD/BITS constexpr arguments.
    TRITON_INT: dict[int, object] = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}

    @triton.jit  # type: ignore[untyped-decorator]
    def split_item(
        item: tl.tensor,  # int64 flat work-item index
        num_layers: tl.tensor,  # layers in the address table
        size0: tl.tensor,  # outer region dim sizes (1 when unused)
        size1: tl.tensor,
        size2: tl.tensor,
        num_chunks: tl.tensor,  # chunks per contiguous run
    ) -> tuple[tl.tensor, ...]:
        """Decompose ``item`` into (id index, layer, outer0, outer1, outer2, chunk)."""
        chunk = item % num_chunks
        rest = item // num_chunks
        o2 = rest % size2
        rest = rest // size2
        o1 = rest % size1
        rest = rest // size1
        o0 = rest % size0
        rest = rest // size0
        layer = rest % num_layers
        idx = rest // num_layers
        return idx, layer, o0, o1, o2, chunk
