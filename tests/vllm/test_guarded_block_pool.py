"""``GuardedBlockPool``'s own calls, as vLLM's managers make them: the null block and
blocks of another pool are routed as vLLM's own pool routes them, a double free
changes nothing, and the compiled noting of filled blocks notes what the Python loop
does."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import MambaManager  # noqa: E402

from kvguard import BlockHash, BlockState, DoubleFreeError, fast_path  # noqa: E402
from kvguard.adapters.vllm.config import GuardConfig  # noqa: E402
from kvguard.adapters.vllm.pool.block_pool import GuardedBlockPool  # noqa: E402
from kvguard.block import PendingPublication  # noqa: E402
from kvguard.errors import ConsistencyError, CorruptionError  # noqa: E402

from .harness import BLOCK, make_request  # noqa: E402

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


def test_how_a_release_goes_is_said_in_the_call() -> None:
    """vLLM's own calls pass nothing: unvalidated blocks are quarantined. A request
    leaving after a clean step has them validated as they are released."""
    pool = _pool()
    vllm_freed, clean_freed = pool.get_new_blocks(2), pool.get_new_blocks(2)
    pool.free_blocks(vllm_freed)
    pool.free_blocks(reversed(clean_freed), steps_passed=True)
    assert [b.state for b in vllm_freed] == [BlockState.QUARANTINED] * 2
    assert [b.state for b in clean_freed] == [BlockState.FREE] * 2  # plain frees
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
    before = pool.core.snapshot()
    pool.free_blocks(reversed(theirs))
    assert pool.core.snapshot() == before
    assert [b.ref_cnt for b in theirs] == [0, 0]


def test_a_double_free_raises_and_releases_nothing() -> None:
    pool = _pool()
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([b])
    before = pool.core.snapshot()
    with pytest.raises(DoubleFreeError):
        pool.free_blocks([a, b])
    assert pool.core.snapshot() == before
    assert a.ref_cnt == 1


def test_touch_takes_references_on_hits_but_not_on_the_null_block() -> None:
    pool = _pool()
    core = pool.core
    (block,) = pool.get_new_blocks(1)
    core.publish_block(block.block_id, BlockHash(b"h" * 16 + bytes(4)), owner="r")
    pool.validate_fills([block.block_id])
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and block.state is BlockState.PUBLISHED
    null_refs = pool.null_block.ref_cnt
    pool.touch([pool.null_block, block])
    assert block.ref_cnt == 1
    assert pool.null_block.ref_cnt == null_refs
    pool.check_consistency()


def _taken(pool: GuardedBlockPool) -> tuple[dict[str, list[int]], dict[int, PendingPublication]]:
    """What the pool's outbox holds (no scheduler drives it), taken, and the
    publications it holds back for those blocks."""
    fills: dict[str, list[int]] = {}
    for owner, block_ids, _, _ in pool.take_cached():
        fills.setdefault(owner, []).extend(block_ids)
    return fills, dict(pool.pending)


def _noted(
    compiled: bool, num_cached: int, publish_first: bool
) -> tuple[dict[str, list[int]], dict[int, PendingPublication], list[object], object]:
    """What ``cache_full_blocks`` notes for 5 full blocks of a request, with the
    compiled noting loop or the Python one."""
    pool = GuardedBlockPool(16, True, BLOCK, guard=GUARD)
    if not compiled:
        pool._fill_notes = None
    request = make_request("r", list(range(5 * BLOCK)))
    blocks = pool.get_new_blocks(5)
    core = pool.core
    if publish_first:
        # A block no step in flight writes (e.g. loaded by a connector and vouched
        # for): published at once, which the compiled loop leaves to the Python one.
        core.validate_blocks([blocks[3].block_id])
    pool.cache_full_blocks(request, blocks, num_cached, 5, BLOCK, 1)
    pool.check_consistency()
    fills, publications = _taken(pool)
    return (
        fills,
        publications,
        [(b.state, b.num_hash_tokens, b.block_hash) for b in blocks],
        core.snapshot(),
    )


@pytest.mark.parametrize("publish_first", [False, True])
@pytest.mark.parametrize("num_cached", [0, 2])
def test_compiled_fill_noting_notes_what_the_python_loop_notes(
    num_cached: int, publish_first: bool
) -> None:
    if not fast_path.available():
        pytest.skip("kvguard._speedups is not built")
    assert GuardedBlockPool(16, True, BLOCK, guard=GUARD)._fill_notes is not None
    compiled = _noted(True, num_cached, publish_first)
    assert compiled == _noted(False, num_cached, publish_first)
    fills, publications = compiled[:2]
    assert fills == {"r": list(publications)}
    assert len(publications) == 5 - num_cached - publish_first


def test_compiled_fill_noting_with_hashes_missing_fails_as_the_python_loop() -> None:
    """Fewer block hashes than full blocks (vLLM's contract broken): the compiled loop
    notes nothing and leaves it to the Python loop, whose strict zip raises."""
    noted = []
    for compiled in (True, False):
        pool = GuardedBlockPool(16, True, BLOCK, guard=GUARD)
        if not compiled:
            pool._fill_notes = None
        request = make_request("r", list(range(3 * BLOCK)))
        blocks = pool.get_new_blocks(4)
        with pytest.raises(ValueError, match="zip"):
            pool.cache_full_blocks(request, blocks, 0, 4, BLOCK, 0)
        noted.append((_taken(pool), [b.num_hash_tokens for b in blocks]))
    assert noted[0] == noted[1]


def _relocate(pool: BlockPool, block: Any) -> None:
    """vLLM's relocation of a speculative Mamba block (0.32 to 0.34), which asserts the
    block is exclusively owned and unhashed (``is_block_writable``)."""
    manager = SimpleNamespace(block_pool=pool, _null_block=pool.null_block)
    MambaManager._relocate_speculative_block(manager, [block], 0)


@pytest.mark.parametrize("guarded", [False, True], ids=["stock", "guarded"])
def test_a_connector_pin_still_makes_a_block_shared_for_vllm(guarded: bool) -> None:
    """A connector pins a block being written (touch(): SimpleCPU offloading pins the
    blocks a load writes). kvguard keeps that pin apart from ``ref_cnt`` (the block has
    one owner in kvguard), yet the pool answers ``is_block_writable`` as vLLM's own
    does: vLLM's refusal to relocate a block someone else holds still fires, and the
    block is writable again once the pin is released."""
    pool: BlockPool = (
        GuardedBlockPool(16, True, 4, guard=GUARD) if guarded else BlockPool(16, True, 4)
    )
    (block,) = pool.get_new_blocks(1)
    assert pool.is_block_writable(block)
    pool.touch([block])
    assert block.ref_cnt == (1 if guarded else 2)
    assert not pool.is_block_writable(block)
    with pytest.raises(AssertionError, match="exclusively owned and unhashed"):
        _relocate(pool, block)
    pool.free_blocks([block])  # the pin's release
    assert block.ref_cnt == 1
    assert pool.is_block_writable(block)
    _relocate(pool, block)
    if isinstance(pool, GuardedBlockPool):
        pool.check_consistency()


def test_a_copy_on_write_reference_makes_a_block_shared_for_vllm() -> None:
    """vLLM's copy-on-write takes a reference by writing ``ref_cnt``, which kvguard
    disowns (retain_for_copy): the source is not writable until that reference goes."""
    pool = _pool()
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt += 1  # (vLLM's _apply_cow)
    pool.retain_for_copy(block)
    assert block.ref_cnt == 1
    assert not pool.is_block_writable(block)
    pool.free_blocks([block])
    assert pool.is_block_writable(block)
    assert not pool.is_block_writable(pool.null_block)
    pool.check_consistency()


def test_a_broken_view_is_a_consistency_error_not_an_assertion() -> None:
    """check_consistency reports every disagreement between vLLM's view and kvguard's
    as kvguard's corruption error (a kvguard bug), never a bare AssertionError, which
    a vendored test expected to fail with one would hide."""
    pool = _pool()
    (block,) = pool.get_new_blocks(1)
    pool.blocks[5].is_null = True
    pool.free_blocks([block])  # quarantined
    pool.pending[block.block_id] = (BlockHash(b"h" * 20), None, "r")  # (wrong now)
    with pytest.raises(ConsistencyError) as info:
        pool.check_consistency()
    assert not isinstance(info.value, AssertionError)
    assert isinstance(info.value, CorruptionError)
    message = str(info.value)
    assert "block 5 is a second null block" in message
    assert f"block {block.block_id} held for publication is QUARANTINED" in message
