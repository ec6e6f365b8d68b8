"""How a KV cache is laid out in memory, described once and checked once.

An engine hands kvguard its per-layer cache tensors and says which of the supported
layouts they use; every kernel then reads the same description::

    FLASH_ATTN   [2, num_blocks, block_size, heads, head_dim]   K/V outermost (vLLM flash-attn)
    FLASHINFER   [num_blocks, 2, block_size, heads, head_dim]   K/V inside each block
    MLA          [num_blocks, block_size, dim]                  one latent vector per token

Tensors may be strided views (a permuted HND cache, a slice of a bigger allocation) as
long as the last dim is contiguous and no two elements alias. Kernels address memory
through a table of per-layer base addresses, so all layers must share shape, strides,
dtype and device — one launch then covers every layer.

For the kernels a region of memory (one block, or one token of one block, in one layer) is
reduced to at most three strided "outer" dims around one contiguous run of bytes: dims
are sorted by stride and merged where contiguous, so a packed FlashInfer block is a single
run and a FlashAttention block is two (K and V).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvguard.errors import PoolMisuseError

__all__ = ["SUPPORTED_DTYPES", "KVCacheLayout", "LayoutError", "LayoutKind", "Region"]

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)

# Kernels handle regions with up to this many strided dims around the contiguous run.
MAX_OUTER_DIMS = 3


class LayoutError(PoolMisuseError):
    """The cache tensors do not match the layout they were described with."""


class LayoutKind(enum.Enum):
    """The supported cache layouts; the value spells the shape."""

    FLASH_ATTN = "[2, num_blocks, block_size, heads, head_dim]"
    FLASHINFER = "[num_blocks, 2, block_size, heads, head_dim]"
    MLA = "[num_blocks, block_size, dim]"

    @property
    def ndim(self) -> int:
        return 3 if self is LayoutKind.MLA else 5

    @property
    def block_dim(self) -> int:
        """The dim indexed by block id."""
        return 1 if self is LayoutKind.FLASH_ATTN else 0

    @property
    def token_dim(self) -> int:
        """The dim indexed by the token's offset inside its block."""
        return 1 if self is LayoutKind.MLA else 2

    @property
    def kv_dim(self) -> int | None:
        """The dim of size 2 that separates K from V (None for MLA)."""
        return {LayoutKind.FLASH_ATTN: 0, LayoutKind.FLASHINFER: 1}.get(self)


@dataclass(frozen=True, slots=True)
class Region:
    """Memory of one block (or one token slot) in one layer, relative to its start.

    ``outer`` holds exactly :data:`MAX_OUTER_DIMS` ``(size, stride)`` pairs (padded with
    ``(1, 0)``), outermost first; ``inner`` is the length of the contiguous run each outer
    index starts. Units are bytes, or words after :meth:`in_words`.
    """

    outer: tuple[tuple[int, int], ...]
    inner: int

    @property
    def numel(self) -> int:
        return math.prod(size for size, _ in self.outer) * self.inner

    def in_words(self, word_bytes: int) -> Region:
        """The same region counted in ``word_bytes``-wide words (which must divide it)."""
        values = [self.inner, *(stride for _, stride in self.outer)]
        if any(v % word_bytes for v in values):
            raise ValueError(f"region {self} is not made of {word_bytes}-byte words")
        return Region(
            outer=tuple((size, stride // word_bytes) for size, stride in self.outer),
            inner=self.inner // word_bytes,
        )


def _collapse(dims: list[tuple[int, int]], itemsize: int) -> Region:
    """Reduce ``(size, stride_bytes)`` dims to a contiguous run inside strided outer dims.

    Order does not matter for zeroing or scanning (the *set* of bytes does), so dims are
    sorted by stride and merged from the innermost while they are contiguous.
    """
    live = sorted((d for d in dims if d[0] != 1), key=lambda d: d[1])
    inner = itemsize
    while live and live[0][1] == inner:
        inner *= live.pop(0)[0]
    outer = [(size, stride) for size, stride in reversed(live)]
    if len(outer) > MAX_OUTER_DIMS:
        raise LayoutError(
            f"a region has {len(outer)} non-contiguous dims (sizes/byte strides {outer}); "
            f"kernels handle at most {MAX_OUTER_DIMS}: make heads and head_dim contiguous"
        )
    outer += [(1, 0)] * (MAX_OUTER_DIMS - len(outer))
    return Region(outer=tuple(outer), inner=inner)


def _check_no_overlap(shape: Sequence[int], strides: Sequence[int], name: str) -> None:
    """Refuse views in which two indices share memory (zeroing one would zero both).

    Sufficient test: sorted by stride, each dim's stride exceeds the span of all smaller
    dims. Every dense or sliced/permuted cache passes; broadcast (stride 0) views fail.
    """
    span = 0
    for size, stride in sorted(
        ((s, st) for s, st in zip(shape, strides, strict=True) if s != 1), key=lambda d: d[1]
    ):
        if stride <= span:
            raise LayoutError(
                f"{name} has overlapping elements (shape {tuple(shape)}, strides "
                f"{tuple(strides)}): a write to one block could reach another; pass the "
                "cache itself, not an expanded or aliased view"
            )
        span += (size - 1) * stride


class KVCacheLayout:
    """Per-layer KV cache tensors plus the layout they follow. Immutable once built.

    ``caches``: one tensor per layer, each of the shape ``kind`` spells, all with the same
    shape, strides, dtype and device. ``block_size``: if given, must equal the token dim
    (catches a pool and a cache that disagree). Raises :class:`LayoutError` otherwise.
    """

    __slots__ = (
        "_address_table",
        "_base_alignment",
        "_block_region",
        "_caches",
        "_kind",
        "_token_region",
    )

    def __init__(
        self,
        caches: Sequence[torch.Tensor],
        kind: LayoutKind,
        *,
        block_size: int | None = None,
    ) -> None:
        caches = tuple(caches)
        if not caches:
            raise LayoutError("a layout needs at least one layer's cache tensor")
        if not isinstance(kind, LayoutKind):
            raise LayoutError(f"kind must be a LayoutKind, not {kind!r}")
        first = caches[0]
        for i, cache in enumerate(caches):
            if not isinstance(cache, torch.Tensor):
                raise LayoutError(f"layer {i}: expected a torch.Tensor, got {type(cache)}")
            if cache.dim() != kind.ndim:
                raise LayoutError(
                    f"layer {i}: {kind.name} caches are {kind.value} ({kind.ndim} dims), "
                    f"got shape {tuple(cache.shape)}"
                )
            mismatch = [
                what
                for what, a, b in (
                    ("shape", cache.shape, first.shape),
                    ("strides", cache.stride(), first.stride()),
                    ("dtype", cache.dtype, first.dtype),
                    ("device", cache.device, first.device),
                )
                if a != b
            ]
            if mismatch:
                raise LayoutError(
                    f"layer {i} differs from layer 0 in {', '.join(mismatch)} "
                    f"({tuple(cache.shape)}/{cache.stride()}/{cache.dtype}/{cache.device} vs "
                    f"{tuple(first.shape)}/{first.stride()}/{first.dtype}/{first.device}); "
                    "one launch serves all layers, so they must match"
                )
        if first.dtype not in SUPPORTED_DTYPES:
            raise LayoutError(
                f"cache dtype {first.dtype} is not supported; use one of "
                f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}"
            )
        kv_dim = kind.kv_dim
        if kv_dim is not None and first.shape[kv_dim] != 2:
            raise LayoutError(
                f"{kind.name} caches are {kind.value}: dim {kv_dim} must be 2 (K and V), "
                f"got shape {tuple(first.shape)}"
            )
        if first.numel() == 0:
            raise LayoutError(f"cache of shape {tuple(first.shape)} is empty")
        if block_size is not None and first.shape[kind.token_dim] != block_size:
            raise LayoutError(
                f"block_size={block_size} but the cache's token dim {kind.token_dim} is "
                f"{first.shape[kind.token_dim]} (shape {tuple(first.shape)}, {kind.name})"
            )
        if first.stride(-1) != 1:
            raise LayoutError(
                f"the last dim must be contiguous (stride 1), got strides {first.stride()}"
            )
        _check_no_overlap(first.shape, first.stride(), "the cache")

        item = first.element_size()
        shape, strides = first.shape, first.stride()
        dims = [(size, stride * item) for size, stride in zip(shape, strides, strict=True)]
        block_dims = [d for i, d in enumerate(dims) if i != kind.block_dim]
        token_dims = [d for i, d in enumerate(dims) if i not in (kind.block_dim, kind.token_dim)]

        self._caches = caches
        self._kind = kind
        self._block_region = _collapse(block_dims, item)
        self._token_region = _collapse(token_dims, item)
        self._base_alignment = math.gcd(8, *(c.data_ptr() for c in caches))
        # Built once: kernels reach every layer through this table of base addresses.
        self._address_table = torch.tensor(
            [c.data_ptr() for c in caches], dtype=torch.int64, device=first.device
        )

    # --- what the caller described ---------------------------------------------------
    @property
    def caches(self) -> tuple[torch.Tensor, ...]:
        return self._caches

    @property
    def kind(self) -> LayoutKind:
        return self._kind

    @property
    def num_layers(self) -> int:
        return len(self._caches)

    @property
    def num_blocks(self) -> int:
        return int(self._caches[0].shape[self._kind.block_dim])

    @property
    def block_size(self) -> int:
        return int(self._caches[0].shape[self._kind.token_dim])

    @property
    def dtype(self) -> torch.dtype:
        return self._caches[0].dtype

    @property
    def device(self) -> torch.device:
        return self._caches[0].device

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block summed over all layers (what zeroing one block writes)."""
        return self._block_region.numel * self.num_layers

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one token slot summed over all layers."""
        return self._token_region.numel * self.num_layers

    # --- what the kernels read -------------------------------------------------------
    @property
    def address_table(self) -> torch.Tensor:
        """int64 ``[num_layers]`` on the cache's device: each layer's base address."""
        return self._address_table

    @property
    def block_stride_bytes(self) -> int:
        return self._caches[0].stride(self._kind.block_dim) * self._caches[0].element_size()

    @property
    def token_stride_bytes(self) -> int:
        return self._caches[0].stride(self._kind.token_dim) * self._caches[0].element_size()

    @property
    def block_region(self) -> Region:
        """Bytes of one block in one layer, relative to ``base + block * block_stride``."""
        return self._block_region

    @property
    def token_region(self) -> Region:
        """Bytes of one token slot in one layer, relative to the slot's first byte."""
        return self._token_region

    def word_bytes(self, region: Region, *strides: int) -> int:
        """The widest word (8, 4, 2 or 1 bytes) that tiles ``region`` at every base.

        Zeroing is dtype-agnostic: it stores zero words, and wider words mean fewer
        stores. Every base address, stride and run length must be a multiple of it.
        """
        values = [self._base_alignment, region.inner, *strides]
        values += [stride for _, stride in region.outer]
        return math.gcd(8, *values)

    def __repr__(self) -> str:
        return (
            f"KVCacheLayout({self._kind.name}, layers={self.num_layers}, "
            f"shape={tuple(self._caches[0].shape)}, dtype={self.dtype}, device={self.device})"
        )


def checked_ids(
    ids: Sequence[int] | torch.Tensor, limit: int, device: torch.device, what: str
) -> torch.Tensor:
    """``ids`` as a contiguous int64 tensor on ``device``, each checked to be in ``[0, limit)``.

    The check runs *before* any launch so a bad id raises :class:`LayoutError` instead of
    writing outside the cache. For a CUDA tensor of ids this reads back its min and max
    (one host synchronisation); pass a list to avoid it.
    """
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise LayoutError(
                f"{what}s must be a 1-D int32/int64 tensor, got {ids.dtype} of shape "
                f"{tuple(ids.shape)}"
            )
        out = ids.to(device=device, dtype=torch.int64).contiguous()
        if out.numel():
            lo, hi = (int(v) for v in torch.aminmax(out))
            _check_range(lo, hi, limit, what)
        return out
    values = [int(v) for v in ids]
    if values:
        _check_range(min(values), max(values), limit, what)
    return torch.tensor(values, dtype=torch.int64, device=device)


def _check_range(lo: int, hi: int, limit: int, what: str) -> None:
    if lo < 0 or hi >= limit:
        raise LayoutError(
            f"{what} {lo if lo < 0 else hi} is outside [0, {limit}) for this cache; "
            "is the pool bigger than the cache it was bound to?"
        )
