"""audit_blocks: per-block "holds NaN/±Inf in some layer" flags, exact."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import torch

from kvguard.kernels import LayoutError, LayoutKind, audit_blocks

from .cases import ALL_KINDS, DTYPES, STRIDINGS, build_cache

# A non-finite bit pattern per dtype (float8_e4m3fn has no Inf: 0x7F is its NaN).
BAD = {
    torch.float32: [0x7FC00000, 0x7F800000, 0xFF800000 - 2**32],
    torch.float16: [0x7E00, 0x7C00, 0xFC00 - 2**16],
    torch.bfloat16: [0x7FC0, 0x7F80, 0xFF80 - 2**16],
    torch.float8_e4m3fn: [0x7F, -1],  # +NaN, -NaN (0xFF)
}


def _poison(
    layout_caches: tuple[torch.Tensor, ...],
    kind: LayoutKind,
    layer: int,
    block: int,
    pattern: int,
    where: int,
) -> None:
    """Write a raw bit pattern into one element of one block of one layer."""
    blk = layout_caches[layer].select(kind.block_dim, block)
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32}[blk.element_size()]
    flat = blk.view(ints)
    index = torch.unravel_index(torch.tensor(where % flat.numel()), flat.shape)
    flat[tuple(int(i) for i in index)] = pattern


# Every dtype on dense caches, every striding in one dtype: the interpreter walks strided
# regions item by item (~10 ms each), and dtype and striding do not interact here.
CASES = [("dense", d) for d in DTYPES] + [(s, torch.float16) for s in STRIDINGS[1:]]


@ALL_KINDS
@pytest.mark.parametrize(("striding", "dtype"), CASES, ids=lambda v: str(v).split(".")[-1])
def test_flags_exactly_the_poisoned_blocks(
    kind: LayoutKind, dtype: torch.dtype, striding: str
) -> None:
    if striding == "hnd" and kind is LayoutKind.MLA:
        pytest.skip("MLA has no heads dim")
    _, layout = build_cache(
        kind,
        dtype,
        num_layers=3,
        num_blocks=7,
        block_size=3,
        heads=3,
        head_dim=5,
        striding=striding,
        fill="finite",
        seed=31,
    )
    ids = [0, 1, 2, 3, 4, 5, 6]
    assert audit_blocks(layout, ids, backend="triton").tolist() == [False] * 7
    # One bad value each: block 1 in layer 0 (first element), block 4 in layer 1 (last),
    # block 6 in layer 1 (middle); patterns cycle through NaN / +Inf / -Inf.
    for (layer, block, where), pattern in zip(
        [(0, 1, 0), (1, 4, -1), (1, 6, 37)], BAD[dtype] * 2, strict=False
    ):
        _poison(layout.caches, kind, layer, block, pattern, where)
    # Clean blocks 0 and 5 sit right next to poisoned ones; 6 is asked twice.
    ids = [0, 1, 6, 4, 6, 5]
    want = [False, True, True, True, True, False]
    flags = audit_blocks(layout, ids, backend="triton", max_programs=3)
    assert flags.dtype == torch.bool and flags.tolist() == want
    assert audit_blocks(layout, ids, backend="torch").tolist() == want


def test_large_finite_values_are_not_flagged() -> None:
    _, layout = build_cache(LayoutKind.MLA, torch.float8_e4m3fn, fill="finite", seed=32)
    layout.caches[0][2, 1, 0] = 448.0  # e4m3fn max: exponent bits all set, but finite
    layout.caches[1][3, 0, 0] = -448.0
    assert audit_blocks(layout, [2, 3], backend="triton").tolist() == [False, False]
    assert audit_blocks(layout, [2, 3], backend="torch").tolist() == [False, False]


def test_empty_and_out_of_range() -> None:
    _, layout = build_cache(LayoutKind.FLASHINFER, torch.float16, num_blocks=5, fill="finite")
    assert audit_blocks(layout, [], backend="triton").tolist() == []
    with pytest.raises(LayoutError, match=r"block id 5 is outside \[0, 5\)"):
        audit_blocks(layout, [0, 5], backend="triton")
