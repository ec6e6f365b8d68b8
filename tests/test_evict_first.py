"""``BlockSteps.evict_first``: cached blocks a lower tier holds are evicted before the
other cached blocks (vLLM's ``free_blocks(..., evict_first=True)``, which SimpleCPU's
lazy offloading relies on: a block it copied goes back to the eviction end, so the
next allocations take it instead of a block no tier holds yet).
"""

from __future__ import annotations

import pytest

from kvguard import BlockPool, BlockState
from kvguard.errors import UnknownBlockError
from kvguard.hashing import BlockHash


def _cached_pool(n_cached: int, n_blocks: int = 8) -> tuple[BlockPool, list[int]]:
    """A pool whose first ``n_cached`` allocated blocks are cached (published, no
    reference), released in id order; the others are empty."""
    pool = BlockPool(n_blocks, 4, check_invariants=True)
    ids = pool.allocate_blocks(n_cached)
    pool.write_blocks(ids)
    for i, block_id in enumerate(ids):
        pool.publish_block(block_id, BlockHash(bytes([i + 1]) * 16))
    pool.validate_blocks(ids)
    pool.release_blocks(ids)
    assert {pool.block_info(b).state for b in ids} == {BlockState.PUBLISHED}
    return pool, ids


def test_named_cached_blocks_move_to_the_front_of_the_cached_ones() -> None:
    pool, (a, b, c, d) = _cached_pool(4)
    empty = list(pool.free_block_ids())[:-4]
    assert list(pool.free_block_ids())[-4:] == [a, b, c, d]  # least recently released first
    pool.block_steps.evict_first([d, c])
    assert list(pool.free_block_ids()) == [*empty, d, c, a, b]
    # An allocation past the empty blocks evicts them first.
    taken = pool.allocate_blocks(len(empty) + 2)
    assert taken[-2:] == [d, c]
    assert pool.block_info(a).state is BlockState.PUBLISHED
    pool.check_invariants()


def test_blocks_not_queued_as_cached_are_left_where_they_are() -> None:
    pool, (a, b, c) = _cached_pool(3)
    (held,) = pool.allocate_blocks(1)
    (quarantined,) = pool.allocate_blocks(1)
    pool.write_blocks([quarantined])
    pool.release_blocks([quarantined])  # never validated: quarantined
    before = list(pool.free_block_ids())
    assert before[0] == quarantined
    pool.block_steps.evict_first([quarantined, held, before[1]])  # quarantined, held, empty
    assert list(pool.free_block_ids()) == before
    pool.block_steps.evict_first([held, c])
    assert list(pool.free_block_ids()) == [*before[:-3], c, a, b]
    assert pool.block_info(held).ref_cnt == 1
    pool.check_invariants()


def test_an_id_outside_the_pool_is_refused_changing_nothing() -> None:
    pool, (_, b) = _cached_pool(2)
    before = list(pool.free_block_ids())
    with pytest.raises(UnknownBlockError, match="99"):
        pool.block_steps.evict_first([b, 99])
    with pytest.raises(UnknownBlockError):
        pool.block_steps.evict_first(["b"])  # type: ignore[list-item]
    assert list(pool.free_block_ids()) == before
