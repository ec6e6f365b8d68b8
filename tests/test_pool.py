"""Unit tests of the pool's operations, one behaviour each."""

from __future__ import annotations

import dataclasses

import pytest

from kvguard import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockState,
    BlockStored,
    Counters,
    OutOfBlocksError,
    RequestAborted,
    RollbackError,
    SlotRange,
    StaleHitError,
    StepOutcome,
    ZeroPolicy,
    default_block_hasher,
    hash_block_tokens,
)

from .conftest import make_pool
from .helpers import admit, prefill, states

S = BlockState
PROMPT = list(range(16))


def publish(pool: BlockPool, rid: str, tokens: list[int]) -> None:
    prefill(pool, rid, tokens)
    pool.validate_step(rid)


# ---------------------------------------------------------------- hashing


def test_hashes_are_chained_and_salted() -> None:
    a = hash_block_tokens(list(range(8)), 4)
    b = hash_block_tokens([9, 9, 9, 9, 4, 5, 6, 7], 4)
    assert len(a) == 2 and a[1] != b[1]  # same block content, different prefix
    assert hash_block_tokens(list(range(9)), 4) == a  # trailing partial block: no hash
    salted = hash_block_tokens(list(range(8)), 4, salt=b"tenant-1")
    assert salted[0] != a[0] and salted[1] != a[1]
    assert hash_block_tokens(list(range(8)), 4, salt=b"tenant-1") == salted
    # An empty salt is no salt; a salt never collides with a parent hash of equal bytes.
    assert default_block_hasher(None, [1, 2], None) == default_block_hasher(None, [1, 2], b"")
    parent = a[0]
    assert default_block_hasher(parent, [1, 2], None) != default_block_hasher(None, [1, 2], parent)


def test_salted_requests_do_not_share() -> None:
    pool = make_pool()
    pool.add_request("a", PROMPT, salt=b"x")
    pool.allocate("a", 16)
    pool.write("a", 16)
    pool.validate_step("a")
    pool.add_request("b", PROMPT, salt=b"y")
    assert pool.lookup("b").num_tokens == 0
    pool.add_request("c", PROMPT, salt=b"x")
    assert pool.lookup("c").num_tokens == 16


def test_caller_supplied_hashes() -> None:
    pool = make_pool()
    hashes = hash_block_tokens(PROMPT, 4)
    pool.add_request("a", block_hashes=hashes[:2])
    pool.allocate("a", 16)
    pool.write("a", 16)
    result = pool.validate_step("a")
    assert len(result.published) == 2  # the other two wait for their hashes
    assert pool.append_block_hashes("a", hashes[2:]) == pool.block_table("a")[2:]
    pool.add_request("b", PROMPT)  # token ids hashed by the default hasher agree
    assert pool.lookup("b").num_tokens == 16


def test_caller_supplied_hashes_that_repeat_end_the_hit_before_the_repeat() -> None:
    """Hashes given by the caller may repeat (chained ones never do): a hit naming one
    block twice would put it twice in the request's block table."""
    pool = make_pool()
    (h,) = hash_block_tokens(PROMPT[:4], 4)
    pool.add_request("a", block_hashes=[h])
    pool.allocate("a", 4)
    pool.write("a", 4)
    pool.validate_step("a")
    pool.add_request("b", block_hashes=[h, h, h])
    hit = pool.lookup("b")
    assert hit.block_ids == pool.block_table("a") and hit.num_tokens == 4
    pool.allocate("b", 12, hit=hit)
    pool.check_invariants()


# ---------------------------------------------------------------- publication


def test_publication_waits_for_token_ids() -> None:
    pool = make_pool()
    pool.add_request("a", PROMPT[:6])
    pool.allocate("a", 8)
    pool.write("a", 8)  # async decode: tokens 6 and 7 are placeholders so far
    result = pool.validate_step("a")
    assert result.published == pool.block_table("a")[:1]
    assert states(pool, "a") == [S.PUBLISHED, S.VALIDATED]
    assert pool.append_tokens("a", [6, 7]) == pool.block_table("a")[1:]
    assert states(pool, "a") == [S.PUBLISHED, S.PUBLISHED]


def test_events_are_emitted_at_validation_only() -> None:
    pool = make_pool()
    prefill(pool, "a", PROMPT)
    assert pool.take_events() == []
    assert pool.stats().counters.deferred_publications == 4
    pool.validate_step("a")
    (stored,) = pool.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == tuple(hash_block_tokens(PROMPT, 4))
    assert stored.parent_hash is None
    assert pool.take_events() == []


def test_duplicate_content_stays_validated() -> None:
    pool = make_pool()
    prefill(pool, "a", PROMPT)
    prefill(pool, "b", PROMPT)  # same prompt, written before a validated
    pool.validate_step("a")
    result = pool.validate_step("b")
    assert result.published == ()
    assert states(pool, "b") == [S.VALIDATED] * 4
    pool.free("b")  # duplicates go back to the free queue as plain FREE blocks
    assert pool.stats().blocks_by_state[S.FREE] == 12


def test_caching_off_never_publishes_but_blocks_are_storable() -> None:
    pool = make_pool(enable_caching=False)
    publish(pool, "a", PROMPT)
    assert states(pool, "a") == [S.VALIDATED] * 4
    pool.add_request("b", PROMPT)
    assert pool.lookup("b").num_tokens == 0
    assert pool.storable_blocks("a") == pool.block_table("a")
    ticket = pool.begin_store(pool.block_table("a")[0], "cpu")
    assert pool.ack_store(ticket)
    assert pool.block_info(ticket.block_id).state is S.VALIDATED


def test_async_pipeline_validates_in_order() -> None:
    pool = make_pool()
    pool.add_request("a", PROMPT)
    pool.allocate("a", 16)
    first = pool.write("a", 6)
    second = pool.write("a", 6)  # step N+1 scheduled before N's result
    assert (first.start, first.end, second.start, second.end) == (0, 6, 6, 12)
    r1 = pool.validate_step("a")
    # Block 1 holds tokens 4..7: 4,5 validated, 6,7 still in flight.
    assert states(pool, "a") == [S.PUBLISHED, S.WRITTEN, S.WRITTEN, S.ALLOCATED]
    assert r1.num_validated_tokens == 6
    r2 = pool.validate_step("a")
    assert r2.tokens.start == 6 and r2.tokens.end == 12
    assert states(pool, "a") == [S.PUBLISHED, S.PUBLISHED, S.PUBLISHED, S.ALLOCATED]


def test_failure_discards_later_inflight_results() -> None:
    pool = make_pool()
    pool.add_request("a", PROMPT)
    pool.allocate("a", 16)
    pool.write("a", 4)
    pool.write("a", 4)
    pool.write("a", 4)
    assert pool.validate_step("a").outcome is StepOutcome.VALIDATED
    failed = pool.fail_step("a")
    assert failed.quarantined == pool.block_table("a")[1:3]
    assert pool.validate_step("a").outcome is StepOutcome.DISCARDED  # step 3's result
    (aborted,) = [e for e in pool.take_events() if isinstance(e, RequestAborted)]
    assert aborted.num_validated_tokens == 4
    assert states(pool, "a") == [S.PUBLISHED, S.QUARANTINED, S.QUARANTINED, S.ALLOCATED]


# ---------------------------------------------------------------- free queue


def test_quarantined_blocks_are_reused_first_and_zeroed() -> None:
    pool = make_pool(8, 4)
    prefill(pool, "a", PROMPT[:8])
    pool.fail_step("a")
    bad = set(pool.block_table("a"))
    pool.free("a")
    pool.add_request("b", [1])
    new = pool.allocate("b", 8)
    assert set(new) == bad
    assert sorted(pool.take_blocks_to_zero()) == sorted(bad)
    assert pool.take_blocks_to_zero() == []


def test_free_block_ids_walk_the_free_queue_in_hand_out_order() -> None:
    """Quarantined, then empty, then cached blocks (least recently released first); a
    walk can resume after any free block, and yields nothing after a held one."""
    pool = make_pool(12, 4)
    (held,) = pool.allocate_blocks(1)
    publish(pool, "old", PROMPT[:8])  # two cached blocks once freed
    old = pool.block_table("old")
    pool.free("old")
    publish(pool, "new", [7] * 8)
    new = pool.block_table("new")
    pool.free("new")
    prefill(pool, "bad", PROMPT[8:16])
    pool.fail_step("bad")
    pool.free("bad")  # two quarantined blocks
    order = list(pool.free_block_ids())
    assert held not in order and len(order) == pool.get_num_free_blocks()
    states = [pool.block_state(b) for b in order]
    assert states[:2] == [S.QUARANTINED] * 2 and S.QUARANTINED not in states[2:]
    assert states[-4:] == [S.PUBLISHED] * 4 and S.PUBLISHED not in states[:-4]
    assert set(order[-4:-2]) == set(old) and set(order[-2:]) == set(new)
    for i, block_id in enumerate(order):
        assert list(pool.free_block_ids(after=block_id)) == order[i + 1 :]
    assert list(pool.free_block_ids(after=held)) == []
    before = pool.snapshot()
    assert pool.allocate_blocks(len(order)) == order  # the order allocation takes them
    assert pool.snapshot() != before


def test_freed_written_blocks_are_quarantined() -> None:
    """Preemption / client abort before the step's result: bytes can't be trusted."""
    pool = make_pool(8, 4)
    prefill(pool, "a", PROMPT[:6])
    pool.free("a")
    assert pool.stats().blocks_by_state[S.QUARANTINED] == 2
    assert pool.stats().counters.blocks_quarantined == 2


def test_validated_blocks_need_no_zeroing() -> None:
    pool = make_pool(4, 4)
    publish(pool, "a", PROMPT)
    pool.free("a")
    pool.add_request("b", [1])
    pool.allocate("b", 16)  # evicts all four published blocks
    assert pool.take_blocks_to_zero() == []
    (removed,) = [e for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert len(removed.block_ids) == 4
    assert pool.stats().counters.blocks_evicted == 4


@pytest.mark.parametrize(
    ("policy", "zeroed"), [(ZeroPolicy.ALL, 4), (ZeroPolicy.SUSPECT, 2), (ZeroPolicy.NONE, 0)]
)
def test_zero_policies(policy: ZeroPolicy, zeroed: int) -> None:
    pool = make_pool(4, 4, zero_policy=policy)
    prefill(pool, "a", PROMPT[:8])
    pool.fail_step("a")
    pool.free("a")
    pool.take_blocks_to_zero()
    pool.add_request("b", [1])
    pool.allocate("b", 16)
    assert len(pool.take_blocks_to_zero()) == zeroed


def test_lru_eviction_tail_first_and_retention() -> None:
    pool = make_pool(8, 4)
    publish(pool, "keep", list(range(100, 108)))  # 2 blocks
    publish(pool, "a", PROMPT[:8])
    pool.free("a")  # released first -> evicted first
    pool.free("keep")
    keep_blocks = set(pool.snapshot().free_queue[2][2:])
    pool.add_request("b", [1])
    pool.allocate("b", 4 * 6)  # 4 empty blocks + 2 evictions
    assert keep_blocks.isdisjoint(pool.block_table("b"))

    pool2 = make_pool(8, 4)
    pool2.add_request("vip", list(range(100, 108)), retention=5)
    pool2.allocate("vip", 8)
    pool2.write("vip", 8)
    pool2.validate_step("vip")
    publish(pool2, "a", PROMPT[:8])
    pool2.free("a")
    pool2.free("vip")  # released last, but its retention class keeps it longest
    vip = set(pool2.snapshot().free_queue[2][2:])
    pool2.add_request("b", [1])
    pool2.allocate("b", 4 * 6)
    assert vip.isdisjoint(pool2.block_table("b"))
    pool2.add_request("c", [1])
    pool2.allocate("c", 8)
    assert set(pool2.block_table("c")) == vip


def test_out_of_blocks_is_atomic() -> None:
    pool = make_pool(4, 4)
    publish(pool, "a", PROMPT[:8])
    pool.free("a")
    pool.add_request("b", [1])
    before = pool.snapshot()
    with pytest.raises(OutOfBlocksError) as info:
        pool.allocate("b", 20)
    assert (info.value.needed, info.value.available) == (5, 4)
    assert pool.snapshot() == before
    assert not pool.can_allocate("b", 20) and pool.can_allocate("b", 16)


def test_hit_on_evictable_blocks_counts_against_free() -> None:
    pool = make_pool(4, 4)
    publish(pool, "a", PROMPT)
    pool.free("a")
    pool.add_request("b", PROMPT + [1])
    hit = pool.lookup("b")
    assert hit.num_tokens == 16
    # Taking the 4 cached blocks leaves no free block for the 17th token.
    assert not pool.can_allocate("b", 17, hit=hit)
    with pytest.raises(OutOfBlocksError):
        pool.allocate("b", 17, hit=hit)
    assert pool.allocate("b", 16, hit=hit) == ()


# ---------------------------------------------------------------- tiers and taint


def test_invalidate_taints_descendants_tiers_and_reports_requests() -> None:
    pool = make_pool(16, 4)
    publish(pool, "a", PROMPT)
    hashes = hash_block_tokens(PROMPT, 4)
    t = pool.begin_store(pool.block_table("a")[3], "cpu")
    assert pool.ack_store(t)
    pool.free("a")
    pool.add_request("b", PROMPT)
    hit = pool.lookup("b")
    pool.allocate("b", 16, hit=hit)
    report = pool.invalidate([hashes[1]])
    assert report.hashes == tuple(hashes[1:])  # blocks 2 and 3 were computed on block 1
    assert set(report.block_ids) == set(pool.block_table("b")[1:])
    assert report.tier_copies == (("cpu", hashes[3]),)
    assert report.requests == ("b",)
    assert states(pool, "b") == [S.PUBLISHED] + [S.QUARANTINED] * 3
    pool.add_request("c", PROMPT)
    assert pool.lookup("c").num_tokens == 4
    pool.free("b")
    assert pool.stats().blocks_by_state[S.QUARANTINED] == 3


def test_invalidate_without_descendants_and_of_free_cached_blocks() -> None:
    pool = make_pool(8, 4)
    publish(pool, "a", PROMPT)
    pool.free("a")
    hashes = hash_block_tokens(PROMPT, 4)
    report = pool.invalidate([hashes[0]], descendants=False)
    assert report.hashes == (hashes[0],) and report.requests == ()
    quarantined, _, evictable = pool.snapshot().free_queue
    assert len(quarantined) == 1 and len(evictable) == 3


def test_tier_copy_bookkeeping() -> None:
    pool = make_pool(8, 4)
    publish(pool, "a", PROMPT)
    block = pool.block_table("a")[0]
    ticket = pool.begin_store(block, "cpu")
    pool.fail_store(ticket)
    assert block in pool.storable_blocks("a", "cpu")
    ticket = pool.begin_store(block, "cpu")
    assert pool.ack_store(ticket)
    assert block not in pool.storable_blocks("a", "cpu")
    assert block in pool.storable_blocks("a", "disk")
    h = ticket.block_hash
    assert pool.tier_copies(h) == ("cpu",)
    assert pool.forget_tier_copy("cpu", h) and not pool.forget_tier_copy("cpu", h)
    counters = pool.stats().counters
    assert (counters.stores_started, counters.stores_failed, counters.stores_acknowledged) == (
        2,
        1,
        1,
    )


def test_store_tickets_are_frozen_store_tickets_and_equal_copies_are_accepted() -> None:
    import dataclasses

    from kvguard import StoreTicket

    pool = make_pool(8, 4)
    publish(pool, "a", PROMPT)
    block = pool.block_table("a")[0]
    ticket = pool.begin_store(block, "cpu")
    assert type(ticket) is StoreTicket
    fields = dataclasses.astuple(ticket)
    assert ticket == StoreTicket(*fields) and hash(ticket) == hash(StoreTicket(*fields))
    assert fields == (
        ticket.ticket_id,
        block,
        pool.block_hash(block),
        ticket.generation,
        "cpu",
        None,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        ticket.generation += 1  # type: ignore[misc]
    # The pool accepts the ticket it issued, or an equal copy of it (e.g. unpickled).
    assert pool.ack_store(dataclasses.replace(ticket))


# ---------------------------------------------------------------- rollback


def test_zero_request_tail_default_rolls_back_to_validated() -> None:
    pool = make_pool(8, 4)
    pool.add_request("a", PROMPT)
    pool.allocate("a", 16)
    pool.write("a", 6)
    pool.validate_step("a")
    pool.write("a", 5)  # tokens 6..10 in flight when the rank fails
    table = pool.block_table("a")
    rollback = pool.zero_request_tail("a")
    assert rollback.num_tokens == 6 and rollback.num_tokens_wiped == 5
    assert rollback.slots == (SlotRange(table[1], 2, 4), SlotRange(table[2], 0, 3))
    assert pool.take_slots_to_zero() == list(rollback.slots)
    assert states(pool, "a") == [S.PUBLISHED, S.VALIDATED, S.ALLOCATED, S.ALLOCATED]
    progress = pool.progress("a")
    assert (progress.num_written_tokens, progress.num_validated_tokens) == (6, 6)
    assert progress.num_pending_steps == 0
    # Resume: the request writes the same tokens again and carries on.
    pool.write("a", 10)
    pool.validate_step("a")
    assert states(pool, "a") == [S.PUBLISHED] * 4


def test_zero_request_tail_revives_aborted_request() -> None:
    pool = make_pool(8, 4)
    pool.add_request("a", PROMPT)
    pool.allocate("a", 16)
    pool.write("a", 8)
    pool.validate_step("a")
    pool.write("a", 8)
    pool.fail_step("a")
    rollback = pool.zero_request_tail("a")
    assert rollback.num_tokens == 8 and not pool.progress("a").aborted
    assert states(pool, "a") == [S.PUBLISHED, S.PUBLISHED, S.ALLOCATED, S.ALLOCATED]
    pool.write("a", 8)
    pool.validate_step("a")
    assert states(pool, "a") == [S.PUBLISHED] * 4


def test_zero_request_tail_by_count_truncates_inflight_step() -> None:
    pool = make_pool(8, 4)
    pool.add_request("a", PROMPT)
    pool.allocate("a", 16)
    pool.write("a", 10)  # in flight
    rollback = pool.zero_request_tail("a", 3)
    assert rollback.num_tokens == 7
    assert rollback.slots == (SlotRange(pool.block_table("a")[1], 3, 4),) + (
        SlotRange(pool.block_table("a")[2], 0, 2),
    )
    # The kept part of the truncated step is still pending; its result validates it.
    assert pool.progress("a").num_pending_steps == 1
    result = pool.validate_step("a")
    assert result.tokens.end == 7
    assert states(pool, "a") == [S.PUBLISHED, S.VALIDATED, S.ALLOCATED, S.ALLOCATED]


def test_zero_request_tail_rolls_back_validated_private_blocks() -> None:
    pool = make_pool(8, 4, enable_caching=False)
    publish(pool, "a", PROMPT)
    rollback = pool.zero_request_tail("a", 6)
    assert rollback.num_tokens == 10
    assert states(pool, "a") == [S.VALIDATED, S.VALIDATED, S.VALIDATED, S.ALLOCATED]
    assert pool.progress("a").num_validated_tokens == 10


# ---------------------------------------------------------------- block level and reset


def test_block_level_allocate_acquire_release() -> None:
    pool = make_pool(8, 4)
    publish(pool, "a", PROMPT)
    ids = pool.allocate_blocks(3)
    assert all(pool.block_info(b).state is S.ALLOCATED for b in ids)
    cached = pool.block_table("a")[0]
    pool.acquire_blocks([cached])
    assert pool.block_info(cached).ref_cnt == 2
    pool.release_blocks([*ids, cached])
    assert pool.block_info(cached).ref_cnt == 1
    assert pool.get_num_free_blocks() == 4


def test_reset_prefix_cache() -> None:
    pool = make_pool(8, 4)
    publish(pool, "a", PROMPT)
    assert not pool.reset_prefix_cache()  # blocks still held
    pool.free("a")
    pool.take_events()
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.stats().blocks_by_state[S.FREE] == 8
    pool.add_request("b", PROMPT)
    assert pool.lookup("b").num_tokens == 0


def test_stats_and_hit_rate() -> None:
    pool = make_pool(16, 4)
    publish(pool, "a", PROMPT)
    admit(pool, "b", PROMPT)
    stats = pool.stats()
    assert stats.blocks_by_state[S.PUBLISHED] == 4
    assert stats.num_requests == 2
    assert stats.counters.lookup_hit_tokens == 12  # capped at len - 1, whole blocks
    assert 0 < stats.prefix_hit_rate < 1
    assert stats.usage == 1 - stats.num_free / 16


def test_env_variable_turns_invariant_checks_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvguard import InvariantViolation

    monkeypatch.setenv("KVGUARD_CHECK_INVARIANTS", "1")
    pool = BlockPool(4, 4)
    pool.add_request("a", PROMPT)
    pool._kernel.blocks[3].ref_cnt = 7  # a bug inside the pool (block 3 is handed out last)...
    with pytest.raises(InvariantViolation):  # ...caught by the next mutating call
        pool.allocate("a", 4)
    monkeypatch.setenv("KVGUARD_CHECK_INVARIANTS", "0")
    quiet = BlockPool(4, 4)
    quiet._kernel.blocks[3].ref_cnt = 7
    quiet.add_request("a", PROMPT)


def test_zero_request_tail_keeps_the_token_sampled_by_the_last_validated_step() -> None:
    pool = make_pool(8, 4)
    pool.add_request("a", PROMPT[:6])
    pool.allocate("a", 8)
    pool.write("a", 6)
    pool.validate_step("a")
    pool.append_tokens("a", [60])  # sampled by the validated step: the input at 6
    pool.write("a", 1)
    pool.append_tokens("a", [61])  # sampled by the step that will be rolled back
    pool.zero_request_tail("a")
    assert pool.snapshot().requests[0].token_ids == (*PROMPT[:6], 60)
    pool.write("a", 2)  # positions 6 and 7 are written again
    pool.validate_step("a")
    assert pool.append_tokens("a", [62]) == pool.block_table("a")[1:]  # block 1 now full


def test_zero_request_tail_with_nothing_to_wipe_changes_nothing() -> None:
    pool = make_pool(8, 4)
    pool.add_request("a", PROMPT)
    pool.allocate("a", 16)
    pool.write("a", 6)
    pool.validate_step("a")
    before = pool.snapshot()
    rollback = pool.zero_request_tail("a")
    assert rollback.num_tokens_wiped == 0 and rollback.slots == ()
    assert pool.snapshot().blocks == before.blocks
    assert pool.take_slots_to_zero() == []


def test_zero_request_tail_never_keeps_a_tainted_prefix() -> None:
    pool = make_pool(8, 4, enable_caching=True)
    pool.add_request("a", PROMPT)
    pool.allocate("a", 16)
    pool.write("a", 16)
    pool.validate_step("a")
    pool.add_request("b", PROMPT)
    hashes = hash_block_tokens(PROMPT, 4)
    report = pool.invalidate([hashes[3]])  # block 3 of a is corrupt after all
    assert report.requests == ("a",) and pool.progress("a").aborted
    assert pool.progress("a").num_validated_tokens == 12  # back to the tainted block
    before = pool.snapshot()
    with pytest.raises(RollbackError, match="invalidated KV"):
        pool.zero_request_tail("a", 2)  # would keep tokens 12, 13 of the tainted block
    assert pool.snapshot() == before
    rollback = pool.zero_request_tail("a", 4)  # the whole tainted block goes
    assert rollback.num_tokens == 12
    assert states(pool, "a") == [S.PUBLISHED] * 3 + [S.ALLOCATED]


def test_cheap_accessors_agree_with_block_info() -> None:
    pool = make_pool(8, 4)
    publish(pool, "a", PROMPT)
    for block_id in range(8):
        info = pool.block_info(block_id)
        assert pool.block_state(block_id) is info.state
        assert pool.block_hash(block_id) == info.block_hash
    assert pool.block_hash(pool.block_table("a")[0]) == hash_block_tokens(PROMPT, 4)[0]


def test_a_hit_looked_up_for_another_request_is_a_stale_hit() -> None:
    pool = make_pool(16, 4)
    publish(pool, "a", PROMPT)
    pool.add_request("b", PROMPT)
    pool.add_request("c", PROMPT)
    hit_of_b = pool.lookup("b", max_tokens=15)
    before = pool.snapshot()
    with pytest.raises(StaleHitError, match="belongs to request 'b', not 'c'"):
        pool.allocate("c", 16, hit=hit_of_b)
    with pytest.raises(StaleHitError):
        pool.can_allocate("c", 16, hit=hit_of_b)
    assert pool.snapshot() == before
    pool.allocate("b", 16, hit=hit_of_b)  # still good for the request it was looked up for


def test_repr_names_the_size_and_where_the_blocks_are() -> None:
    pool = make_pool(16, 4)
    assert repr(pool) == (
        "<BlockPool num_blocks=16 block_size=4 held=0 allocatable=16 "
        "(empty=16 quarantined=0 evictable=0) cached=0 requests=0>"
    )
    publish(pool, "a", PROMPT)  # 4 blocks, published
    pool.free("a")  # ... and evictable
    prefill(pool, "b", [9] * 8)  # 2 blocks, written
    pool.fail_step("b")
    prefill(pool, "c", [7] * 8)
    pool.free("b")  # 2 quarantined
    stats = pool.stats()
    assert stats.num_free == 16 - 2 and stats.num_evictable == 4
    assert repr(pool) == (
        "<BlockPool num_blocks=16 block_size=4 held=2 allocatable=14 "
        "(empty=8 quarantined=2 evictable=4) cached=4 requests=1>"
    )


def test_repr_of_a_pool_whose_construction_failed_does_not_raise() -> None:
    class Half(BlockPool):
        def __init__(self) -> None:
            raise RuntimeError("before the pool was built")

    half = Half.__new__(Half)
    assert repr(half) == "<Half, not built>"


def test_deferred_publications_count_what_waited_for_validation() -> None:
    pool = make_pool(16, 4)
    prefill(pool, "a", PROMPT[:10])  # fills 2 blocks: their publication waits
    assert pool.counters().deferred_publications == 2
    assert pool.counters().blocks_published == 0
    pool.validate_step("a")
    assert pool.counters().blocks_published == 2


def test_the_old_counter_name_reads_the_new_one_with_a_deprecation_warning() -> None:
    counters = Counters(deferred_publications=3)
    with pytest.warns(DeprecationWarning, match="deferred_publications"):
        assert counters.withheld_publications == 3
    with pytest.raises(AttributeError):
        counters.withheld_publications = 4  # type: ignore[misc]  # read-only
    assert "withheld_publications" not in {f.name for f in dataclasses.fields(Counters)}


def test_num_free_counts_evictable_blocks_that_blocks_by_state_free_does_not() -> None:
    pool = make_pool(16, 4)
    publish(pool, "a", PROMPT)
    pool.free("a")  # 4 PUBLISHED blocks, evictable
    stats = pool.stats()
    assert stats.num_free == 16 == pool.get_num_free_blocks()
    assert stats.num_evictable == 4
    assert stats.blocks_by_state[S.FREE] == 12
