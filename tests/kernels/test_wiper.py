"""CacheWiper: a real BlockPool's zeroing queues reach a real cache tensor."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import torch

from kvguard import BlockPool
from kvguard.kernels import (
    CacheWiper,
    KVCacheLayout,
    LayoutError,
    LayoutKind,
    TailWipe,
)
from kvguard.results import SlotRange

BLOCK = 4


def _setup(backend: str = "triton") -> tuple[BlockPool, KVCacheLayout, CacheWiper]:
    pool = BlockPool(8, BLOCK, check_invariants=True)
    caches = [torch.randn(8, 2, BLOCK, 2, 3) for _ in range(2)]  # FlashInfer, 2 layers
    layout = KVCacheLayout(caches, LayoutKind.FLASHINFER, block_size=BLOCK)
    return pool, layout, CacheWiper(pool, layout, backend=backend)  # type: ignore[arg-type]


def _token_zero(layout: KVCacheLayout, block: int, token: int) -> bool:
    return all(not c[block, :, token].view(torch.int32).any() for c in layout.caches)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_zero_request_tail_wipes_exactly_the_failed_tokens(backend: str) -> None:
    pool, layout, wiper = _setup(backend)
    pool.add_request("r", list(range(10)))
    blocks = pool.allocate("r", 10)  # 3 blocks: tokens 0-3, 4-7, 8-9
    pool.write("r", 6)
    pool.validate_step("r")  # tokens 0..5 validated
    pool.write("r", 4)  # tokens 6..9: this step fails on some rank
    pool.fail_step("r")
    before = [c.clone() for c in layout.caches]

    wipe = wiper.zero_request_tail("r")

    assert isinstance(wipe, TailWipe)
    assert (wipe.request_id, wipe.num_tokens, wipe.num_tokens_wiped) == ("r", 6, 4)
    assert wipe.slots == (SlotRange(blocks[1], 2, 4), SlotRange(blocks[2], 0, 2))
    assert wipe.num_slots_wiped == 4
    wiped = {(blocks[1], 2), (blocks[1], 3), (blocks[2], 0), (blocks[2], 1)}
    for b in range(8):
        for t in range(BLOCK):
            if (b, t) in wiped:
                assert _token_zero(layout, b, t), (b, t)
            else:  # the validated prefix of block 1 included
                for old, new in zip(before, layout.caches, strict=True):
                    assert torch.equal(old[b, :, t], new[b, :, t]), (b, t)
    assert pool.take_slots_to_zero() == []  # drained by the same call
    assert pool.progress("r").num_written_tokens == 6


def test_zero_request_tail_with_explicit_token_count() -> None:
    pool, layout, wiper = _setup()
    pool.add_request("r", list(range(7)))
    blocks = pool.allocate("r", 7)
    pool.write("r", 7)
    pool.validate_step("r")
    wipe = wiper.zero_request_tail("r", 2)
    assert (wipe.num_tokens, wipe.num_tokens_wiped) == (5, 2)
    assert _token_zero(layout, blocks[1], 1) and _token_zero(layout, blocks[1], 2)
    assert not _token_zero(layout, blocks[1], 0)


def test_flush_zeroes_quarantined_blocks_before_reuse() -> None:
    pool, layout, wiper = _setup()
    pool.add_request("bad", list(range(8)))
    bad_blocks = pool.allocate("bad", 8)
    pool.write("bad", 8)
    pool.fail_step("bad")
    pool.free("bad")
    assert wiper.flush().block_ids == ()  # nothing queued until a block is reused
    pool.add_request("next", list(range(100, 108)))
    reused = pool.allocate("next", 8)
    assert set(reused) == set(bad_blocks)  # quarantined blocks are handed out first
    others = [b for b in range(8) if b not in reused]
    before = [c[others].clone() for c in layout.caches]
    result = wiper.flush()
    assert sorted(result.block_ids) == sorted(reused) and result.num_slots == 0
    for old, c in zip(before, layout.caches, strict=True):
        assert not c[list(reused)].view(torch.int32).any()
        assert torch.equal(c[others], old)
    assert wiper.flush().block_ids == ()


def test_refuses_a_pool_the_cache_does_not_fit() -> None:
    caches = [torch.zeros(8, 2, BLOCK, 2, 3)]
    layout = KVCacheLayout(caches, LayoutKind.FLASHINFER)
    with pytest.raises(LayoutError, match="block_size"):
        CacheWiper(BlockPool(8, BLOCK * 2), layout)
    with pytest.raises(LayoutError, match="only 8"):
        CacheWiper(BlockPool(9, BLOCK), layout)
    CacheWiper(BlockPool(6, BLOCK), layout)  # smaller pool: fine
