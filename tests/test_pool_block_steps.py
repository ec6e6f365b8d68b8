"""The block-level step ledger: write_blocks / validate_blocks / fail_blocks / publish_block.

Holders that keep their own block tables (vLLM's KVCacheManager) name the blocks a
step writes; publication asked for while a block is being written waits for its
validation; a failed or abandoned step quarantines what it wrote.
"""

from __future__ import annotations

import pytest

from kvguard import BlockPool, BlockState, BlockStored, IllegalTransitionError, ZeroPolicy
from kvguard.errors import (
    DoubleFreeError,
    ForeignBlockError,
    NoPendingStepError,
    PoolMisuseError,
)
from kvguard.hashing import BlockHash
from kvguard.results import PublishOutcome

H1 = BlockHash(b"h1" * 8)
H2 = BlockHash(b"h2" * 8)


def _pool(n: int = 6) -> BlockPool:
    return BlockPool(n, 4, check_invariants=True)


def _state(pool: BlockPool, block_id: int) -> BlockState:
    return pool.block_info(block_id).state


def test_publication_waits_for_validation() -> None:
    pool = _pool()
    (b,) = pool.allocate_blocks(1)
    pool.write_blocks([b])
    assert pool.publish_block(b, H1, owner="r1") is PublishOutcome.DEFERRED
    assert pool.cached_block_id(H1) is None
    assert _state(pool, b) is BlockState.WRITTEN
    pool.take_events()
    result = pool.validate_blocks([b])
    assert result.validated == (b,) and result.published == (b,)
    assert pool.cached_block_id(H1) == b
    assert _state(pool, b) is BlockState.PUBLISHED
    assert pool.take_events() == [BlockStored("r1", (H1,), (b,), None)]
    assert pool.stats().counters.deferred_publications == 1


def test_two_steps_in_flight_validate_in_order() -> None:
    pool = _pool()
    (b,) = pool.allocate_blocks(1)
    pool.write_blocks([b])  # step N writes the first half
    pool.write_blocks([b])  # step N+1 (async) completes it
    pool.publish_block(b, H1)
    assert pool.validate_blocks([b]).validated == ()
    assert pool.cached_block_id(H1) is None, "published while step N+1 is unchecked"
    assert pool.validate_blocks([b]).published == (b,)


def test_failure_quarantines_written_keeps_validated() -> None:
    pool = _pool()
    a, b = pool.allocate_blocks(2)
    pool.write_blocks([a])
    pool.publish_block(a, H1)
    pool.validate_blocks([a])
    pool.write_blocks([b])
    pool.publish_block(b, H2, H1)
    assert pool.fail_blocks([a, b]) == (b,)
    assert _state(pool, a) is BlockState.PUBLISHED
    assert _state(pool, b) is BlockState.QUARANTINED
    assert pool.cached_block_id(H2) is None
    with pytest.raises(NoPendingStepError):
        pool.validate_blocks([b])  # the late result of the failed step
    pool.release_blocks([a, b])
    # The quarantined block is reused first and must be zeroed.
    (c,) = pool.allocate_blocks(1)
    assert c == b and pool.take_blocks_to_zero() == [b]


def test_release_mid_step_quarantines_and_drops_publication() -> None:
    pool = _pool()
    (b,) = pool.allocate_blocks(1)
    pool.write_blocks([b])
    pool.publish_block(b, H1)
    pool.release_blocks([b])  # preempted / aborted before the step's output
    assert _state(pool, b) is BlockState.QUARANTINED
    assert pool.cached_block_id(H1) is None
    assert pool.allocate_blocks(1) == [b]
    assert pool.take_blocks_to_zero() == [b]


def test_validated_blocks_are_not_zeroed_on_reuse() -> None:
    pool = _pool(2)
    (b,) = pool.allocate_blocks(1)
    pool.write_blocks([b])
    pool.validate_blocks([b])
    pool.release_blocks([b])
    pool.allocate_blocks(2)
    assert pool.take_blocks_to_zero() == []


def test_zero_all_policy_zeroes_every_allocation() -> None:
    pool = BlockPool(3, 4, zero_policy=ZeroPolicy.ALL, check_invariants=True)
    assert sorted(pool.allocate_blocks(3)) == sorted(pool.take_blocks_to_zero())


def test_duplicate_hash_stays_validated_and_storable() -> None:
    pool = _pool()
    a, b = pool.allocate_blocks(2)
    pool.write_blocks([a, b])
    pool.validate_blocks([a, b])
    assert pool.publish_block(a, H1) is PublishOutcome.PUBLISHED
    assert pool.publish_block(b, H1) is PublishOutcome.DUPLICATE
    assert _state(pool, b) is BlockState.VALIDATED
    assert pool.begin_store(b).block_hash == H1


def test_rewriting_a_validated_block_drops_its_hash() -> None:
    pool = _pool()
    a, b = pool.allocate_blocks(2)
    pool.write_blocks([a, b])
    pool.validate_blocks([a, b])
    pool.publish_block(a, H1)
    pool.publish_block(b, H1)  # duplicate: keeps the hash, stays VALIDATED
    ticket = pool.begin_store(b)
    pool.write_blocks([b])
    assert pool.block_info(b).block_hash is None
    assert pool.ack_store(ticket) is False, "ack for bytes that changed was registered"


def test_misuse_changes_nothing() -> None:
    pool = _pool()
    a, b = pool.allocate_blocks(2)
    pool.write_blocks([a])
    pool.validate_blocks([a])
    pool.publish_block(a, H1)
    before = pool.snapshot()
    with pytest.raises(IllegalTransitionError):
        pool.write_blocks([b, a])  # a is PUBLISHED: nobody writes into shared KV
    with pytest.raises(NoPendingStepError):
        pool.validate_blocks([b])
    with pytest.raises(PoolMisuseError):
        pool.publish_block(a, H2)
    assert pool.snapshot() == before
    assert _state(pool, b) is BlockState.ALLOCATED


def test_request_level_blocks_are_refused() -> None:
    pool = _pool()
    pool.add_request("r", [1, 2, 3, 4])
    (b,) = pool.allocate("r", 4)
    with pytest.raises(ForeignBlockError):
        pool.write_blocks([b])


def test_quarantined_block_cannot_be_published() -> None:
    pool = _pool()
    (b,) = pool.allocate_blocks(1)
    pool.write_blocks([b])
    pool.fail_blocks([b])
    with pytest.raises(IllegalTransitionError):
        pool.publish_block(b, H1)


def test_caching_off_refuses_publication() -> None:
    pool = BlockPool(2, 4, enable_caching=False)
    (b,) = pool.allocate_blocks(1)
    with pytest.raises(PoolMisuseError):
        pool.publish_block(b, H1)


def test_reset_prefix_cache_keeps_a_placeholder_held() -> None:
    pool = _pool()
    (null,) = pool.allocate_blocks(1)
    (b,) = pool.allocate_blocks(1)
    pool.write_blocks([b])
    pool.validate_blocks([b])
    pool.publish_block(b, H1)
    assert pool.reset_prefix_cache(keep_held=[null]) is False  # b is still held
    pool.release_blocks([b])
    assert pool.reset_prefix_cache() is False  # the placeholder is held
    assert pool.reset_prefix_cache(keep_held=[null]) is True
    assert pool.cached_block_id(H1) is None
    assert pool.block_state(b) is BlockState.FREE
    assert pool.block_state(null) is BlockState.ALLOCATED


def test_write_fast_path_matches_the_table() -> None:
    """Freshly allocated blocks written in one call (the adapter's allocation path)
    take the batched ALLOCATED -> WRITTEN path; counts and writers agree with it."""
    pool = _pool()
    ids = pool.allocate_blocks(3)
    pool.write_blocks(ids)
    assert [_state(pool, b) for b in ids] == [BlockState.WRITTEN] * 3
    stats = pool.stats()
    assert stats.blocks_by_state[BlockState.WRITTEN] == 3
    assert stats.blocks_by_state[BlockState.ALLOCATED] == 0
    # One writer each: a single validation settles them.
    assert pool.validate_blocks(ids).validated == tuple(ids)
    # A duplicated id leaves the fast path: two writers, validated twice.
    (b,) = pool.allocate_blocks(1)
    pool.write_blocks([b, b])
    assert pool.validate_blocks([b]).validated == ()
    assert pool.validate_blocks([b]).validated == (b,)


def test_write_refuses_mixed_batches_atomically() -> None:
    pool = _pool()
    a, b, c = pool.allocate_blocks(3)
    pool.write_blocks([a])
    pool.validate_blocks([a])
    pool.publish_block(a, H1)
    before = pool.snapshot()
    with pytest.raises(IllegalTransitionError):
        pool.write_blocks([b, c, a])
    with pytest.raises(ForeignBlockError):
        pool.write_blocks([b, 5])  # block 5 is FREE: not held through the block API
    assert pool.snapshot() == before


def test_batched_validation_publishes_and_counts() -> None:
    pool = _pool()
    a, b, c = pool.allocate_blocks(3)
    pool.write_blocks([a, b, c])
    assert pool.publish_block(a, H1, owner="r") is PublishOutcome.DEFERRED
    assert pool.publish_block(b, H2, H1, owner="r") is PublishOutcome.DEFERRED
    pool.take_events()
    result = pool.validate_blocks([a, b, c])
    assert result.validated == (a, b, c) and result.published == (a, b)
    assert result.duplicates == ()
    stats = pool.stats()
    assert stats.blocks_by_state[BlockState.PUBLISHED] == 2
    assert stats.blocks_by_state[BlockState.VALIDATED] == 1
    assert stats.counters.blocks_published == 2
    assert pool.take_events() == [
        BlockStored("r", (H1,), (a,), None),
        BlockStored("r", (H2,), (b,), H1),
    ]


def test_validate_errors_change_nothing() -> None:
    pool = _pool()
    a, b = pool.allocate_blocks(2)
    pool.write_blocks([a])
    pool.publish_block(a, H1)
    before = pool.snapshot()
    with pytest.raises(NoPendingStepError):
        pool.validate_blocks([a, a])  # one writer, two validations
    with pytest.raises(NoPendingStepError):
        pool.validate_blocks([a, b])  # b was never written
    assert pool.snapshot() == before


def test_snapshot_sees_writers_and_pending_publication() -> None:
    pool = _pool()
    (a,) = pool.allocate_blocks(1)
    pool.write_blocks([a])
    before = pool.snapshot()
    pool.publish_block(a, H1, owner="r")
    after = pool.snapshot()
    assert after != before
    assert after.blocks[a][3] == 1 and after.blocks[a][4] == (H1, None, "r")


def test_allocate_blocks_write_is_allocate_then_write_blocks() -> None:
    pool = _pool()
    other = _pool()
    ids = pool.allocate_blocks(3, write=True)
    expected = other.allocate_blocks(3)
    other.write_blocks(expected)
    assert ids == expected
    for block_id in ids:
        assert _state(pool, block_id) is BlockState.WRITTEN
        assert pool.block_info(block_id) == other.block_info(block_id)
    assert pool.allocate_blocks(0, write=True) == []
    pool.publish_block(ids[0], H1, owner="r")
    assert pool.validate_blocks(ids).published == (ids[0],)
    with pytest.raises(NoPendingStepError):  # one step each, like write_blocks
        pool.validate_blocks([ids[1]])
    pool.check_invariants()


def test_validate_with_held_publications_publishes_after_validation() -> None:
    pool = _pool()
    a, b, c = pool.allocate_blocks(3, write=True)
    result = pool.validate_blocks(
        [a, b], publish={a: (H1, None, "r1"), b: (H2, H1, "r1"), c: (H1, None, "x")}
    )
    assert result.validated == (a, b)
    assert result.published == (a, b)
    assert pool.cached_block_id(H1) == a and pool.cached_block_id(H2) == b
    assert _state(pool, c) is BlockState.WRITTEN  # its entry is ignored: not validated here
    assert pool.block_hash(c) is None
    assert pool.stats().counters.deferred_publications == 2
    events = [e for e in pool.take_events() if isinstance(e, BlockStored)]
    assert [(e.request_id, e.block_ids, e.parent_hash) for e in events] == [
        ("r1", (a,), None),
        ("r1", (b,), H1),
    ]


def test_held_publication_of_a_block_another_step_still_writes_waits() -> None:
    pool = _pool()
    (a,) = pool.allocate_blocks(1, write=True)
    pool.write_blocks([a])  # a second in-flight step writes it too
    result = pool.validate_blocks([a], publish={a: (H1, None, "r1")})
    assert result.validated == () and pool.cached_block_id(H1) is None
    assert pool.validate_blocks([a]).published == (a,)  # published with the last writer
    assert pool.cached_block_id(H1) == a


def test_held_publication_of_an_indexed_hash_is_a_duplicate() -> None:
    pool = _pool()
    a, b = pool.allocate_blocks(2, write=True)
    result = pool.validate_blocks([a, b], publish={a: (H1, None, ""), b: (H1, None, "")})
    assert (result.published, result.duplicates) == ((a,), (b,))
    assert _state(pool, b) is BlockState.VALIDATED and pool.block_hash(b) == H1


def test_validate_with_held_publications_needs_caching_and_changes_nothing_on_error() -> None:
    pool = BlockPool(4, 4, enable_caching=False, check_invariants=True)
    (a,) = pool.allocate_blocks(1, write=True)
    before = pool.snapshot()
    with pytest.raises(PoolMisuseError):
        pool.validate_blocks([a], publish={a: (H1, None, "")})
    assert pool.snapshot() == before
    pool = _pool()
    a, b = pool.allocate_blocks(2, write=True)
    before = pool.snapshot()
    with pytest.raises(NoPendingStepError):
        pool.validate_blocks([a, b, a], publish={a: (H1, None, ""), b: (H2, H1, "")})
    assert pool.snapshot() == before


def test_record_events_false_keeps_the_event_queue_empty() -> None:
    pool = BlockPool(3, 4, record_events=False, check_invariants=True)
    (a,) = pool.allocate_blocks(1, write=True)
    pool.validate_blocks([a], publish={a: (H1, None, "r1")})
    pool.release_blocks([a])
    pool.allocate_blocks(3)  # evicts a
    assert pool.cached_block_id(H1) is None
    assert pool.take_events() == []
    assert pool.stats().counters.blocks_published == 1


def test_block_type_and_block_records() -> None:
    from dataclasses import dataclass

    from kvguard.block import Block

    @dataclass(slots=True, eq=False)
    class TaggedBlock(Block):
        tag: str = "engine field"

    pool = BlockPool(3, 4, block_type=TaggedBlock, check_invariants=True)
    records = pool.block_records
    assert [type(r) for r in records] == [TaggedBlock] * 3
    (a,) = pool.allocate_blocks(1, write=True)
    assert records[a].state is BlockState.WRITTEN and records[a].ref_cnt == 1
    pool.validate_blocks([a], publish={a: (H1, None, "")})
    assert records[a].block_hash == H1 and pool.prefix_index == {H1: a}
    with pytest.raises(TypeError):
        pool.prefix_index[H2] = a  # type: ignore[index]
    with pytest.raises(PoolMisuseError):
        BlockPool(3, 4, block_type=dict)  # type: ignore[arg-type]


def test_a_waiting_publication_dies_with_the_last_holder_of_an_unwritten_block() -> None:
    pool = _pool()  # check_invariants=True: a leftover publication would raise
    (a,) = pool.allocate_blocks(1)
    assert pool.publish_block(a, H1) is PublishOutcome.DEFERRED
    pool.release_blocks([a])
    assert _state(pool, a) is BlockState.FREE
    (b,) = pool.allocate_blocks(1, write=True)
    assert b == a
    assert pool.validate_blocks([b]).published == ()  # nothing left to publish
    assert pool.cached_block_id(H1) is None


def test_release_after_passed_steps_frees_written_blocks_without_quarantine() -> None:
    pool = _pool(4)
    tail, cached = pool.allocate_blocks(2, write=True)
    pool.validate_blocks([cached], {cached: (H1, None, "r")})  # published, evictable later
    pool.write_blocks([tail])  # a second step in flight writing the tail
    pool.release_blocks([tail, cached], steps_passed=True)  # both of tail's steps passed
    assert _state(pool, tail) is BlockState.FREE
    assert _state(pool, cached) is BlockState.PUBLISHED  # untouched: stays a hit
    assert pool.stats().counters.blocks_quarantined == 0
    assert tail in pool.allocate_blocks(3)  # the FREE blocks, the tail among them
    assert pool.take_blocks_to_zero() == []


def test_release_after_passed_steps_publishes_a_waiting_publication() -> None:
    pool = _pool()
    (a,) = pool.allocate_blocks(1, write=True)
    assert pool.publish_block(a, H1) is PublishOutcome.DEFERRED
    pool.release_blocks([a], steps_passed=True)
    assert _state(pool, a) is BlockState.PUBLISHED
    assert pool.cached_block_id(H1) == a
    assert pool.stats().counters.blocks_published == 1


def test_release_after_passed_steps_changes_nothing_on_error() -> None:
    pool = _pool()
    a, b = pool.allocate_blocks(2, write=True)
    pool.release_blocks([b])  # quarantined: b's step was abandoned
    before = pool.snapshot()
    with pytest.raises(DoubleFreeError):
        pool.release_blocks([a, b], steps_passed=True)
    assert pool.snapshot() == before
    assert _state(pool, a) is BlockState.WRITTEN


@pytest.mark.parametrize(
    "publication",
    [([1], None, "r"), ("h", None, "r"), (H1, 7, "r"), (H1, None, 3), (H1, None)],
)
def test_a_malformed_publication_is_refused_before_anything_changes(
    publication: tuple[object, ...],
) -> None:
    """Hashes are bytes: an unhashable one would otherwise fail half-way through."""
    pool = _pool()
    a, b = pool.allocate_blocks(2, write=True)
    before = pool.snapshot()
    with pytest.raises(PoolMisuseError, match="publication"):
        pool.validate_blocks([a, b], {b: publication})  # type: ignore[dict-item]
    if len(publication) == 3:
        block_hash, parent, owner = publication
        with pytest.raises(PoolMisuseError, match="publication"):
            pool.publish_block(a, block_hash, parent, owner=owner)  # type: ignore[arg-type]
    assert pool.snapshot() == before
    assert pool.validate_blocks([a, b]).validated == (a, b)


def test_a_reference_the_engine_wrote_itself_is_disowned() -> None:
    """An engine whose blocks are kvguard's records raised ``ref_cnt`` itself (vLLM's
    copy-on-write): disown_reference takes it back, and a block being written keeps
    one owner; with no such reference it is refused, changing nothing."""
    pool = _pool()
    (b,) = pool.allocate_blocks(1, write=True)
    record = pool.block_records[b]
    with pytest.raises(PoolMisuseError, match="has one to disown"):
        pool.disown_reference(b)
    assert record.ref_cnt == 1
    record.ref_cnt += 1  # the engine's own write
    pool.disown_reference(b)
    assert record.ref_cnt == 1
    pool.check_invariants()
    pool.release_blocks([b])
    assert _state(pool, b) is BlockState.QUARANTINED
    with pytest.raises(PoolMisuseError):
        pool.disown_reference(b)
