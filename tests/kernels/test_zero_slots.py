"""zero_slots: token-granular wipes keep the valid prefix of a partial block."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import torch

from kvguard.kernels import LayoutError, LayoutKind, slot_ids
from kvguard.kernels.zero_slots import zero_slots
from kvguard.results import SlotRange

from .cases import (
    ALL_DTYPES,
    ALL_KINDS,
    STRIDINGS,
    assert_same_bytes,
    build_cache,
    raw_bytes,
)

# Block size 5 (not a power of two); ranges: a partial tail, a whole block, one slot.
RANGES = [SlotRange(2, 3, 5), SlotRange(6, 0, 5), SlotRange(0, 1, 2)]


@ALL_KINDS
@ALL_DTYPES
@pytest.mark.parametrize("striding", STRIDINGS)
def test_matches_reference_bytewise(kind: LayoutKind, dtype: torch.dtype, striding: str) -> None:
    if striding == "hnd" and kind is LayoutKind.MLA:
        pytest.skip("MLA has no heads dim")
    spec = dict(
        kind=kind,
        dtype=dtype,
        num_layers=2,
        num_blocks=7,
        block_size=5,
        heads=3,
        head_dim=5,
        striding=striding,
        seed=11,
    )
    got, layout = build_cache(**spec)  # type: ignore[arg-type]
    want, ref_layout = build_cache(**spec)  # type: ignore[arg-type]
    assert zero_slots(layout, RANGES, backend="triton") == 8
    assert zero_slots(ref_layout, RANGES, backend="torch") == 8
    assert_same_bytes(got, want)


@ALL_KINDS
def test_partial_block_keeps_its_valid_prefix(kind: LayoutKind) -> None:
    _, layout = build_cache(kind, torch.float16, num_blocks=4, block_size=5, seed=12)
    before = [c.clone() for c in layout.caches]
    zero_slots(layout, [SlotRange(2, 3, 5)], backend="triton")
    for old, new in zip(before, layout.caches, strict=True):
        for b in range(4):
            for t in range(5):
                idx: tuple[int | slice, ...]
                if kind is LayoutKind.FLASH_ATTN:
                    idx = (slice(None), b, t)
                elif kind is LayoutKind.FLASHINFER:
                    idx = (b, slice(None), t)
                else:
                    idx = (b, t)
                got = new[idx].contiguous().view(torch.uint8)
                if b == 2 and t >= 3:
                    assert not got.any(), f"slot ({b}, {t}) not wiped"
                else:
                    want = old[idx].contiguous().view(torch.uint8)
                    assert torch.equal(got, want), f"slot ({b}, {t}) was written"


def test_slot_id_tensor_input() -> None:
    spec = dict(kind=LayoutKind.FLASHINFER, dtype=torch.bfloat16, block_size=3, seed=13)
    got, layout = build_cache(**spec)  # type: ignore[arg-type]
    want, ref_layout = build_cache(**spec)  # type: ignore[arg-type]
    slots = torch.tensor([14, 0, 7, 7], dtype=torch.int32)  # duplicates are harmless
    assert zero_slots(layout, slots, backend="triton") == 4
    zero_slots(
        ref_layout, [SlotRange(4, 2, 3), SlotRange(0, 0, 1), SlotRange(2, 1, 2)], backend="torch"
    )
    assert_same_bytes(got, want)


def test_slot_ids_flattens_ranges() -> None:
    _, layout = build_cache(LayoutKind.MLA, torch.float32, num_blocks=8, block_size=5)
    assert slot_ids(layout, RANGES) == [13, 14, 30, 31, 32, 33, 34, 1]
    assert slot_ids(layout, [SlotRange(3, 2, 2)]) == []


def test_empty_input_wipes_nothing() -> None:
    bases, layout = build_cache(LayoutKind.FLASH_ATTN, torch.float32, seed=14)
    before = raw_bytes(bases)
    assert zero_slots(layout, [], backend="triton") == 0
    assert zero_slots(layout, [SlotRange(1, 2, 2)], backend="triton") == 0
    assert zero_slots(layout, torch.tensor([], dtype=torch.int64), backend="triton") == 0
    assert_same_bytes(bases, before)


@pytest.mark.parametrize(
    ("slots", "match"),
    [
        ([SlotRange(1, 0, 4)], "does not fit a block of 3"),
        ([SlotRange(1, 2, 1)], "does not fit"),
        ([SlotRange(1, -1, 1)], "does not fit"),
        ([SlotRange(0, 0, 1), SlotRange(5, 0, 1)], r"block 5 is outside"),
        (torch.tensor([15]), r"slot id 15 is outside \[0, 15\)"),
        (torch.tensor([-1]), "slot id -1"),
    ],
)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_slots_raise_before_any_write(slots: object, match: str, backend: str) -> None:
    bases, layout = build_cache(LayoutKind.FLASH_ATTN, torch.float16, num_blocks=5, seed=15)
    before = raw_bytes(bases)
    with pytest.raises(LayoutError, match=match):
        zero_slots(layout, slots, backend=backend)  # type: ignore[arg-type]
    assert_same_bytes(bases, before)
