"""seal_blocks: a 64-bit fingerprint per block across layers, the same bit for bit from
the Triton kernel, the torch path and a pure-Python oracle; any change to a block's
bytes -- a flipped bit, a NaN with another payload, two words swapped, a block copied
from elsewhere -- changes its seal, and nothing outside a block does."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import torch

from kvguard.kernels import Backend, LayoutError, LayoutKind
from kvguard.kernels._addressing import int_view
from kvguard.kernels.seal_blocks import fmix64, seal_blocks

from .cases import ALL_KINDS, DTYPES, STRIDINGS, build_cache

M64 = (1 << 64) - 1


def python_seal(layout: object, block: int, salt: int = 0) -> int:
    """The seal by its definition, element by element in Python ints: each layer's
    block read in memory order (ascending byte offset), positions counted across
    layers."""
    total = 0
    position = 0
    for cache in layout.caches:  # type: ignore[attr-defined]
        bits = int_view(cache.select(layout.kind.block_dim, block))  # type: ignore[attr-defined]
        item = cache.element_size()
        # Every element of the block, in ascending memory order.
        offsets = torch.zeros(bits.shape, dtype=torch.int64)
        for dim, (size, stride) in enumerate(zip(bits.shape, bits.stride(), strict=True)):
            shape = [1] * bits.dim()
            shape[dim] = size
            offsets = offsets + torch.arange(size).reshape(shape) * stride
        order = torch.argsort(offsets.flatten())
        for value in bits.flatten()[order].tolist():
            x = value & ((1 << (8 * item)) - 1)
            total += fmix64(((position << 32) | x) ^ (salt & M64))
            position += 1
    total &= M64
    return total - (1 << 64) if total >> 63 else total


def _flip(layout: object, layer: int, block: int, where: int, xor: int) -> None:
    """XOR a raw bit pattern into one element of one block of one layer."""
    blk = layout.caches[layer].select(layout.kind.block_dim, block)  # type: ignore[attr-defined]
    flat = int_view(blk)
    index = tuple(
        int(i) for i in torch.unravel_index(torch.tensor(where % flat.numel()), flat.shape)
    )
    flat[index] = flat[index] ^ xor


CASES = [("dense", d) for d in DTYPES] + [(s, torch.float16) for s in STRIDINGS[1:]]


@ALL_KINDS
@pytest.mark.parametrize(("striding", "dtype"), CASES, ids=lambda v: str(v).split(".")[-1])
def test_kernel_torch_and_the_definition_agree(
    kind: LayoutKind, dtype: torch.dtype, striding: str
) -> None:
    if striding == "hnd" and kind is LayoutKind.MLA:
        pytest.skip("MLA has no heads dim")
    # Random bytes: NaN and Inf patterns included, and sentinels around every block.
    _, layout = build_cache(
        kind, dtype, num_layers=2, num_blocks=5, block_size=3, heads=2, head_dim=5,
        striding=striding, fill="bytes", seed=7,
    )  # fmt: skip
    ids = [4, 0, 2, 2]
    want = [python_seal(layout, b) for b in ids]
    got = seal_blocks(layout, ids, backend="triton", max_programs=3)
    assert got.dtype == torch.int64 and got.tolist() == want
    assert seal_blocks(layout, ids, backend="torch").tolist() == want
    assert len(set(want[:3])) == 3  # different blocks, different seals


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_every_kind_of_change_moves_only_that_blocks_seal(backend: Backend) -> None:
    _, layout = build_cache(
        LayoutKind.FLASHINFER, torch.bfloat16, num_layers=3, num_blocks=6, block_size=4,
        heads=2, head_dim=8, fill="finite", seed=3,
    )  # fmt: skip
    ids = list(range(6))
    before = seal_blocks(layout, ids, backend=backend).tolist()
    assert len(set(before)) == 6
    # Block 1: one sign bit, in the last layer.
    _flip(layout, 2, 1, 17, 0x8000)
    # Block 2: a NaN whose payload changes (NaN != NaN never decides: bits do).
    blk = int_view(layout.caches[0].select(0, 2)).flatten()
    blk[5] = 0x7FC1
    mid = seal_blocks(layout, ids, backend=backend).tolist()
    blk[5] = 0x7FC2
    # Block 3: two words swapped within a layer.
    words = int_view(layout.caches[1].select(0, 3)).flatten()
    assert words[0] != words[9]
    words[0], words[9] = words[9].clone(), words[0].clone()
    # Block 4: the same layer's block 5 copied over it (a copy filed under another prefix).
    layout.caches[0][4] = layout.caches[0][5]
    after = seal_blocks(layout, ids, backend=backend).tolist()
    assert [a != b for a, b in zip(before, after, strict=True)] == [
        False, True, True, True, True, False,
    ]  # fmt: skip
    assert mid[2] != after[2]  # another NaN payload, another seal


def test_two_compensating_changes_and_swapped_layers_are_seen() -> None:
    """What a plain sum of words would miss: +d in one word and -d in another, and the
    same bytes in another order across layers."""
    _, layout = build_cache(
        LayoutKind.FLASHINFER, torch.float32, num_layers=2, num_blocks=2, block_size=2,
        heads=1, head_dim=4, fill="finite", seed=5,
    )  # fmt: skip
    before = seal_blocks(layout, [0, 1], backend="torch").tolist()
    words = int_view(layout.caches[0].select(0, 0)).flatten()
    words[1] += 7
    words[2] -= 7
    layer0, layer1 = layout.caches[0][1].clone(), layout.caches[1][1].clone()
    layout.caches[0][1], layout.caches[1][1] = layer1, layer0
    after = seal_blocks(layout, [0, 1], backend="torch").tolist()
    assert after[0] != before[0] and after[1] != before[1]


def test_the_salt_binds_the_seal() -> None:
    _, layout = build_cache(LayoutKind.FLASH_ATTN, torch.float16, fill="finite", seed=9)
    plain = seal_blocks(layout, [1, 3], backend="triton").tolist()
    salted = seal_blocks(layout, [1, 3], salt=0xDEADBEEF, backend="triton").tolist()
    assert seal_blocks(layout, [1, 3], salt=0xDEADBEEF, backend="torch").tolist() == salted
    assert salted == [python_seal(layout, b, 0xDEADBEEF) for b in (1, 3)]
    assert all(p != s for p, s in zip(plain, salted, strict=True))
    # The salt is taken mod 2**64: a negative int is its two's complement pattern.
    assert seal_blocks(layout, [1], salt=-1, backend="torch").tolist() == [
        python_seal(layout, 1, M64)
    ]


def test_sealing_reads_and_writes_no_cache_byte() -> None:
    bases, layout = build_cache(
        LayoutKind.FLASH_ATTN, torch.float16, striding="every_other_block", seed=11
    )
    copies = [b.clone() for b in bases]
    seal_blocks(layout, [0, 2, 4], backend="triton")
    assert all(torch.equal(int_view(a), int_view(b)) for a, b in zip(bases, copies, strict=True))


def test_bad_ids_and_salts_are_refused_before_any_launch() -> None:
    _, layout = build_cache(LayoutKind.FLASHINFER, torch.float16, num_blocks=5)
    with pytest.raises(LayoutError):
        seal_blocks(layout, [5])
    with pytest.raises(LayoutError):
        seal_blocks(layout, [-1])
    with pytest.raises(LayoutError):
        seal_blocks(layout, [0], salt=1.5)  # type: ignore[arg-type]
    assert seal_blocks(layout, []).tolist() == []
