"""KVCacheLayout: the supported layouts, the regions kernels walk, and clear refusals."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import torch

from kvguard.errors import KvGuardError, PoolMisuseError
from kvguard.kernels import KVCacheLayout, LayoutError, LayoutKind, Region
from kvguard.kernels.layout import _collapse

from .cases import ALL_KINDS, build_cache, logical_shape


@ALL_KINDS
def test_describes_dense_caches(kind: LayoutKind) -> None:
    caches = [torch.zeros(logical_shape(kind, 7, 3, 2, 5), dtype=torch.float16) for _ in range(4)]
    layout = KVCacheLayout(caches, kind, block_size=3)
    assert (layout.num_layers, layout.num_blocks, layout.block_size) == (4, 7, 3)
    assert layout.dtype == torch.float16
    assert layout.address_table.tolist() == [c.data_ptr() for c in caches]
    assert layout.bytes_per_block == 4 * caches[0].numel() * 2 // 7
    assert layout.bytes_per_slot == layout.bytes_per_block // 3


def test_regions_collapse_to_contiguous_runs() -> None:
    # FlashInfer packs K and V of a block together: one run of 2*3*2*5 fp16.
    _, fi = build_cache(LayoutKind.FLASHINFER, torch.float16, block_size=3, heads=2, head_dim=5)
    assert fi.block_region == Region(outer=((1, 0),) * 3, inner=2 * 3 * 2 * 5 * 2)
    # ... but one token's K and V are two runs, a block apart.
    assert fi.token_region == Region(outer=((2, 3 * 10 * 2), (1, 0), (1, 0)), inner=10 * 2)
    # FlashAttention keeps K and V num_blocks * block bytes apart: two runs per block.
    _, fa = build_cache(LayoutKind.FLASH_ATTN, torch.float32, num_blocks=5, block_size=3)
    assert fa.block_region == Region(outer=((2, 5 * 30 * 4), (1, 0), (1, 0)), inner=30 * 4)
    # HND (heads outside tokens in memory) still makes a block contiguous per K/V.
    _, hnd = build_cache(LayoutKind.FLASH_ATTN, torch.float32, striding="hnd")
    assert hnd.block_region.inner == 30 * 4
    assert hnd.token_region == Region(outer=((2, 5 * 30 * 4), (2, 15 * 4), (1, 0)), inner=5 * 4)


def test_word_bytes_follow_alignment() -> None:
    _, fp8 = build_cache(LayoutKind.MLA, torch.float8_e4m3fn, heads=1, head_dim=19)
    assert fp8.word_bytes(fp8.token_region, fp8.token_stride_bytes) == 1  # 19 bytes per slot
    _, f32 = build_cache(LayoutKind.MLA, torch.float32, heads=2, head_dim=4)
    assert f32.word_bytes(f32.block_region, f32.block_stride_bytes) == 8


def test_errors_are_kvguard_misuse_errors() -> None:
    assert issubclass(LayoutError, PoolMisuseError)
    assert issubclass(LayoutError, KvGuardError)


def _fa(n: int = 4, b: int = 3, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.zeros(2, n, b, 2, 5, dtype=dtype)


@pytest.mark.parametrize(
    ("caches", "kind", "kwargs", "match"),
    [
        ([], LayoutKind.MLA, {}, "at least one layer"),
        ([_fa(), _fa(n=5)], LayoutKind.FLASH_ATTN, {}, "layer 1 differs from layer 0 in shape"),
        ([_fa(), _fa(dtype=torch.float32)], LayoutKind.FLASH_ATTN, {}, "in dtype"),
        (
            [_fa(), torch.zeros(2, 4, 2, 3, 5, dtype=torch.float16).transpose(2, 3)],
            LayoutKind.FLASH_ATTN,
            {},
            "in strides",
        ),
        ([_fa()], LayoutKind.FLASH_ATTN, {"block_size": 16}, "block_size=16"),
        ([_fa()], LayoutKind.MLA, {}, "3 dims"),
        ([_fa()], LayoutKind.FLASHINFER, {}, "dim 1 must be 2"),
        ([_fa(dtype=torch.float64)], LayoutKind.FLASH_ATTN, {}, "not supported"),
        ([torch.zeros(4, 3, 8, dtype=torch.int32)], LayoutKind.MLA, {}, "not supported"),
        ([torch.zeros(4, 8, 3).transpose(1, 2)], LayoutKind.MLA, {}, "last dim"),
        ([torch.zeros(1, 3, 8).expand(4, 3, 8)], LayoutKind.MLA, {}, "overlapping"),
        ([torch.zeros(0, 3, 8)], LayoutKind.MLA, {}, "empty"),
        (["not a tensor"], LayoutKind.MLA, {}, "torch.Tensor"),
    ],
)
def test_refuses_what_it_cannot_handle(
    caches: list[torch.Tensor], kind: LayoutKind, kwargs: dict[str, int], match: str
) -> None:
    with pytest.raises(LayoutError, match=match):
        KVCacheLayout(caches, kind, **kwargs)


def test_refuses_a_non_contiguous_last_dim() -> None:
    padded = torch.zeros(2, 4, 3, 5, 2, 7)[..., 0]  # [2, 4, 3, 5, 2], last dim stride 7
    with pytest.raises(LayoutError, match="last dim"):
        KVCacheLayout([padded], LayoutKind.FLASH_ATTN)


def test_collapse_refuses_more_strided_dims_than_kernels_walk() -> None:
    # Unreachable through the three layouts (a contiguous last dim leaves at most three
    # strided dims per block); the guard keeps a future layout from walking wrong memory.
    dims = [(2, 10_000), (3, 1_000), (4, 100), (5, 20), (6, 2)]
    with pytest.raises(LayoutError, match="at most 3"):
        _collapse(dims, 2)
    assert _collapse(dims[1:], 2) == Region(outer=((3, 1_000), (4, 100), (5, 20)), inner=12)
