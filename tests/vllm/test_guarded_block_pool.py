"""``GuardedBlockPool``'s own calls, as vLLM's managers make them: the null block and
blocks of another pool are routed as vLLM's own pool routes them, and a double free
changes nothing."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402

from kvguard import BlockHash, BlockState, DoubleFreeError  # noqa: E402
from kvguard.adapters.vllm.block_pool import GuardedBlockPool  # noqa: E402
from kvguard.adapters.vllm.config import GuardConfig  # noqa: E402

GUARD = GuardConfig(enabled=True, check_invariants=True)


def _pool() -> GuardedBlockPool:
    return GuardedBlockPool(16, True, 4, guard=GUARD)


def test_free_skips_the_null_block_and_routes_another_pools_blocks() -> None:
    pool = _pool()
    other = BlockPool(8, True, 4)
    ours = pool.get_new_blocks(2)
    theirs = other.get_new_blocks(1)
    free_before = pool.get_num_free_blocks()
    other_free_before = other.get_num_free_blocks()
    null_refs = pool.null_block.ref_cnt

    pool.free_blocks([ours[0], pool.null_block, theirs[0], ours[1]])

    assert pool.get_num_free_blocks() == free_before + 2
    assert [b.ref_cnt for b in ours] == [0, 0]
    # WRITTEN blocks released with no clean step vouching for them are quarantined.
    assert [b.state for b in ours] == [BlockState.QUARANTINED] * 2
    assert pool.null_block.ref_cnt == null_refs
    assert theirs[0].ref_cnt == 0
    assert other.get_num_free_blocks() == other_free_before + 1
    pool.check_consistency()


def test_free_skips_the_null_block() -> None:
    """R-SWA block tables hold the null block where vLLM dropped the gap."""
    pool = _pool()
    ours = pool.get_new_blocks(2)
    null_refs = pool.null_block.ref_cnt
    pool.free_blocks([ours[1], pool.null_block, ours[0]])
    assert [b.ref_cnt for b in ours] == [0, 0]
    assert pool.null_block.ref_cnt == null_refs
    assert pool.null_block.state is BlockState.ALLOCATED
    pool.check_consistency()


def test_free_of_only_another_pools_blocks_leaves_this_pool_alone() -> None:
    pool = _pool()
    other = BlockPool(8, True, 4)
    theirs = other.get_new_blocks(2)
    before = pool.core.snapshot()  # type: ignore[union-attr]
    pool.free_blocks(reversed(theirs))
    assert pool.core.snapshot() == before  # type: ignore[union-attr]
    assert [b.ref_cnt for b in theirs] == [0, 0]


def test_a_double_free_raises_and_releases_nothing() -> None:
    pool = _pool()
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([b])
    before = pool.core.snapshot()  # type: ignore[union-attr]
    with pytest.raises(DoubleFreeError):
        pool.free_blocks([a, b])
    assert pool.core.snapshot() == before  # type: ignore[union-attr]
    assert a.ref_cnt == 1


def test_touch_takes_references_on_hits_but_not_on_the_null_block() -> None:
    pool = _pool()
    core = pool.core
    assert core is not None
    (block,) = pool.get_new_blocks(1)
    core.publish_block(block.block_id, BlockHash(b"h" * 16 + bytes(4)), owner="r")
    pool.validate_step([block.block_id])
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and block.state is BlockState.PUBLISHED
    null_refs = pool.null_block.ref_cnt
    pool.touch([pool.null_block, block])
    assert block.ref_cnt == 1
    assert pool.null_block.ref_cnt == null_refs
    pool.check_consistency()
