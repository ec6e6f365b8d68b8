"""zero_blocks: Triton against the torch reference, byte for byte, plus its contracts."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import importlib

import torch

from kvguard.kernels import KVCacheLayout, LayoutError, LayoutKind
from kvguard.kernels.backend import MAX_GRID, launch_grid, resolve_backend
from kvguard.kernels.zero_blocks import zero_blocks, zero_blocks_ref

from .cases import (
    ALL_DTYPES,
    ALL_KINDS,
    ON_GPU,
    STRIDINGS,
    assert_same_bytes,
    build_cache,
    interpreter_only,
    raw_bytes,
)

# The package re-exports the function under the module's name; fetch the module itself.
zero_blocks_module = importlib.import_module("kvguard.kernels.zero_blocks")


def _twin(
    **kwargs: object,
) -> tuple[list[torch.Tensor], KVCacheLayout, list[torch.Tensor], KVCacheLayout]:
    """Two identical caches: one for the kernel, one for the reference."""
    a, la = build_cache(**kwargs)  # type: ignore[arg-type]
    b, lb = build_cache(**kwargs)  # type: ignore[arg-type]
    return a, la, b, lb


@ALL_KINDS
@ALL_DTYPES
@pytest.mark.parametrize("striding", STRIDINGS)
def test_matches_reference_bytewise(kind: LayoutKind, dtype: torch.dtype, striding: str) -> None:
    if striding == "hnd" and kind is LayoutKind.MLA:
        pytest.skip("MLA has no heads dim")
    # Odd sizes everywhere: 7 blocks, block_size 3, 3 heads, head_dim 5, 3 layers.
    spec = dict(
        kind=kind,
        dtype=dtype,
        num_layers=3,
        num_blocks=7,
        block_size=3,
        heads=3,
        head_dim=5,
        striding=striding,
        seed=1,
    )
    got, layout, want, ref_layout = _twin(**spec)
    ids = [6, 0, 3]
    zero_blocks(layout, ids, backend="triton")
    zero_blocks(ref_layout, ids, backend="torch")
    assert_same_bytes(got, want)  # backing allocations: padding and foreign blocks too
    for view in layout.caches:
        for b in ids:
            assert not view.select(kind.block_dim, b).view(torch.uint8).any()


@ALL_KINDS
def test_reference_zeroes_exactly_the_named_blocks(kind: LayoutKind) -> None:
    before, _ = build_cache(kind, torch.float16, num_blocks=6, seed=2)
    bases, layout = build_cache(kind, torch.float16, num_blocks=6, seed=2)
    zero_blocks_ref(layout, torch.tensor([1, 4]))
    for old, new in zip(before, bases, strict=True):
        for b in range(6):
            got = new.select(kind.block_dim, b).view(torch.uint8)
            if b in (1, 4):
                assert not got.any()
            else:
                assert torch.equal(got, old.select(kind.block_dim, b).view(torch.uint8))


@pytest.mark.parametrize(
    ("kind", "dtype", "heads", "head_dim"),
    [
        (LayoutKind.FLASHINFER, torch.float8_e4m3fn, 1, 1),  # a block is K+V = 2 bytes
        (LayoutKind.FLASH_ATTN, torch.float8_e4m3fn, 1, 1),
        (LayoutKind.MLA, torch.float8_e4m3fn, 1, 19),  # 19-byte rows: byte-wide stores
        (LayoutKind.MLA, torch.bfloat16, 1, 1),
    ],
)
def test_packed_neighbours_are_never_touched(
    kind: LayoutKind, dtype: torch.dtype, heads: int, head_dim: int
) -> None:
    _, layout = build_cache(
        kind, dtype, num_blocks=5, block_size=1, heads=heads, head_dim=head_dim, seed=3
    )
    before = [c.clone() for c in layout.caches]
    zero_blocks(layout, [0, 2, 4], backend="triton")
    for old, new in zip(before, layout.caches, strict=True):
        for b in range(5):
            got = new.select(kind.block_dim, b).contiguous().view(torch.uint8)
            if b % 2 == 0:
                assert not got.any(), f"block {b} not zeroed"
            else:
                want = old.select(kind.block_dim, b).contiguous().view(torch.uint8)
                assert torch.equal(got, want), f"neighbour block {b} was written"


@pytest.mark.parametrize("max_programs", [1, 2, 5])
def test_grid_stride_loop_covers_work_beyond_the_grid(max_programs: int) -> None:
    # 4 ids x 2 layers x 2 (K/V) items, walked by 1, 2 or 5 programs.
    got, layout, want, ref_layout = _twin(
        kind=LayoutKind.FLASH_ATTN, dtype=torch.float32, num_blocks=9, seed=4
    )
    zero_blocks(layout, [8, 1, 2, 5], backend="triton", max_programs=max_programs)
    zero_blocks(ref_layout, [8, 1, 2, 5], backend="torch")
    assert_same_bytes(got, want)


def test_launch_grid_stays_valid_for_millions_of_blocks() -> None:
    # 4M blocks x 80 layers x 2 halves: ~6.7e8 items, capped to the programs asked for.
    assert launch_grid(4_000_000 * 80 * 2, 132 * 16) == (132 * 16,)
    assert launch_grid(2**40, 2**40) == (MAX_GRID,)
    assert launch_grid(0, 8) == (1,)
    assert launch_grid(5, 8) == (5,)
    with pytest.raises(ValueError, match="max_programs"):
        launch_grid(5, 0)


def test_duplicate_ids_are_harmless() -> None:
    got, layout, want, ref_layout = _twin(kind=LayoutKind.FLASHINFER, dtype=torch.bfloat16, seed=5)
    zero_blocks(layout, [3, 3, 1, 3], backend="triton")
    zero_blocks(ref_layout, [1, 3], backend="torch")
    assert_same_bytes(got, want)


def test_tensor_ids_int32_and_int64() -> None:
    got, layout, want, ref_layout = _twin(kind=LayoutKind.MLA, dtype=torch.float16, seed=6)
    zero_blocks(layout, torch.tensor([4, 0], dtype=torch.int32), backend="triton")
    zero_blocks(ref_layout, torch.tensor([4, 0], dtype=torch.int64), backend="torch")
    assert_same_bytes(got, want)


def test_empty_ids_launch_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    bases, layout = build_cache(LayoutKind.MLA, torch.float32, seed=7)
    before = raw_bytes(bases)

    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("launched for an empty id list")

    monkeypatch.setattr(zero_blocks_module, "_launch_zero_blocks", no_launch)
    zero_blocks(layout, [], backend="triton")
    zero_blocks(layout, torch.tensor([], dtype=torch.int64), backend="triton")
    assert_same_bytes(bases, before)


@pytest.mark.parametrize(
    "ids",
    [[0, 5], [-1], [2, 99], torch.tensor([1, 5]), torch.tensor([-3])],
    ids=["num_blocks", "negative", "far", "tensor_num_blocks", "tensor_negative"],
)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_out_of_range_ids_raise_before_any_write(ids: object, backend: str) -> None:
    bases, layout = build_cache(LayoutKind.FLASH_ATTN, torch.float16, num_blocks=5, seed=8)
    before = raw_bytes(bases)
    with pytest.raises(LayoutError, match=r"outside \[0, 5\)"):
        zero_blocks(layout, ids, backend=backend)  # type: ignore[arg-type]
    assert_same_bytes(bases, before)


def test_refuses_non_integer_id_tensors() -> None:
    _, layout = build_cache(LayoutKind.MLA, torch.float16)
    with pytest.raises(LayoutError, match="int32/int64"):
        zero_blocks(layout, torch.tensor([1.0]))
    with pytest.raises(LayoutError, match="int32/int64"):
        zero_blocks(layout, torch.tensor([[1]]))


@interpreter_only
def test_auto_backend_runs_triton_under_the_interpreter() -> None:
    assert resolve_backend("auto", torch.device("cpu")) == "triton"
    assert resolve_backend("torch", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="backend must be"):
        resolve_backend("cuda", torch.device("cpu"))  # type: ignore[arg-type]


@pytest.mark.skipif(not ON_GPU, reason="needs KVGUARD_KERNEL_DEVICE=cuda")
def test_auto_backend_runs_compiled_triton_on_cuda() -> None:
    assert resolve_backend("auto", torch.device("cuda")) == "triton"
    assert resolve_backend("auto", torch.device("cpu")) == "torch"  # no interpreter here


def test_item_width_limits_padding() -> None:
    from kvguard.kernels._addressing import chunk_words

    assert chunk_words(2304, 4096) == 512  # MLA: 18 KiB runs, 10% padding instead of 44%
    assert chunk_words(4096, 4096) == 4096  # a FlashAttention block half: one item
    assert chunk_words(4096, 1024) == 1024  # the cap holds
    assert chunk_words(1500, 1024) == 512
    assert chunk_words(300, 4096) == 256  # never narrower than MIN_CHUNK for padding's sake
    assert chunk_words(5, 1024) == 8  # short runs: one item


def test_runs_cut_into_several_padded_items_match_reference() -> None:
    # MLA rows of 600 fp32 = 300 words: two 256-word items per block, the second mostly
    # masked off; the sentinel bytes around every block must survive.
    spec = dict(
        kind=LayoutKind.MLA,
        dtype=torch.float32,
        num_layers=2,
        num_blocks=4,
        block_size=1,
        heads=1,
        head_dim=600,
        seed=9,
    )
    got, layout, want, ref_layout = _twin(**spec)
    zero_blocks(layout, [2, 0], backend="triton")
    zero_blocks(ref_layout, [2, 0], backend="torch")
    assert_same_bytes(got, want)
