"""The scenarios of the core issue: races, chunked prefill failure, decode failure,
late tier acknowledgements — each checked end to end on a real pool."""

from __future__ import annotations

from kvguard import BlockPool, BlockState, BlockStored, StepOutcome

from .conftest import make_pool
from .helpers import admit, prefill, states

S = BlockState
PROMPT = list(range(100, 116))  # 16 tokens = 4 full blocks of 4


def test_async_race_no_hit_before_validation_then_hit_after() -> None:
    pool = make_pool(32, 4)
    # Step N: A's prompt is scheduled; its blocks are written, not validated.
    prefill(pool, "A", PROMPT)
    assert states(pool, "A") == [S.WRITTEN] * 4
    assert pool.take_events() == []  # nothing published at schedule time

    # Step N+1 (async scheduling: A's output is not known yet): B, same prefix.
    hit_b = admit(pool, "B", PROMPT)
    assert hit_b.num_tokens == 0
    assert set(pool.block_table("B")).isdisjoint(pool.block_table("A"))

    # A's step N validates: its full blocks are published, events emitted now.
    result = pool.validate_step("A")
    assert result.outcome is StepOutcome.VALIDATED
    assert states(pool, "A") == [S.PUBLISHED] * 4
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored)
    assert event.block_ids == pool.block_table("A")

    # C, same prefix, admitted after validation: hits A's blocks (capped at len-1).
    hit_c = admit(pool, "C", PROMPT)
    assert hit_c.num_tokens == 12
    assert pool.block_table("C")[:3] == pool.block_table("A")[:3]
    assert [pool.block_info(b).ref_cnt for b in pool.block_table("A")[:3]] == [2, 2, 2]


def test_chunked_prefill_failing_at_chunk_two() -> None:
    pool = make_pool(32, 4)
    prompt = list(range(24))  # 3 chunks of 8 tokens = 2 blocks each
    pool.add_request("A", prompt)
    pool.allocate("A", len(prompt))
    table = pool.block_table("A")

    pool.write("A", 8)
    pool.validate_step("A")  # chunk 1 passes
    pool.write("A", 8)
    failed = pool.fail_step("A")  # chunk 2 fails
    assert failed.outcome is StepOutcome.FAILED
    assert failed.quarantined == table[2:4]
    assert states(pool, "A") == [S.PUBLISHED] * 2 + [S.QUARANTINED] * 2 + [S.ALLOCATED] * 2
    pool.free("A")

    # A retry hits exactly chunk 1's blocks, never chunk 2's.
    hit = admit(pool, "A-retry", prompt)
    assert hit.block_ids == table[:2]
    assert hit.num_tokens == 8
    # Chunk 2's quarantined blocks were reused first and queued for zeroing.
    new_blocks = pool.block_table("A-retry")[2:]
    to_zero = pool.take_blocks_to_zero()
    assert set(table[2:4]) <= set(new_blocks)
    assert sorted(to_zero) == sorted(table[2:4])
    assert pool.stats().counters.blocks_zeroed == 2


def test_decode_failure_keeps_prompt_published() -> None:
    pool = make_pool(32, 4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    prefill(pool, "A", prompt)
    pool.validate_step("A")
    assert states(pool, "A") == [S.PUBLISHED, S.PUBLISHED, S.VALIDATED]

    # Decode: token 10 appended (sampled), step writes 1 token per step.
    for token in (50, 51):
        pool.append_tokens("A", [token])
        pool.allocate("A", pool.progress("A").num_written_tokens + 1)
        pool.write("A", 1)
        pool.validate_step("A")
    # Block 2 is now full (tokens 8..11) and validated -> published.
    assert states(pool, "A") == [S.PUBLISHED] * 3

    pool.append_tokens("A", [52])
    pool.allocate("A", 13)
    pool.write("A", 1)
    result = pool.fail_step("A")
    assert result.tokens.start == 12 and result.tokens.end == 13
    assert states(pool, "A") == [S.PUBLISHED] * 3 + [S.QUARANTINED]
    assert pool.progress("A").aborted
    pool.free("A")
    stats = pool.stats()
    assert stats.blocks_by_state[S.QUARANTINED] == 1
    assert stats.blocks_by_state[S.PUBLISHED] == 3
    assert stats.counters.requests_aborted == 1


def test_late_tier_acknowledgement_is_dropped() -> None:
    pool = make_pool(8, 4)
    prefill(pool, "A", PROMPT)
    pool.validate_step("A")
    first = pool.block_table("A")[0]
    assert pool.storable_blocks("A", "cpu") == pool.block_table("A")

    ticket = pool.begin_store(first, "cpu")
    ok_ticket = pool.begin_store(pool.block_table("A")[1], "cpu")
    assert first not in pool.storable_blocks("A", "cpu")  # in flight already
    assert pool.ack_store(ok_ticket) is True
    assert pool.block_info(ok_ticket.block_id).state is S.OFFLOADED

    # Before the ack arrives, the block is evicted and reused by another request.
    pool.free("A")
    pool.add_request("B", list(range(900, 932)))
    pool.allocate("B", 32)  # needs every block: evicts A's cached ones
    assert first in pool.block_table("B")

    assert pool.ack_store(ticket) is False
    assert pool.stats().counters.dropped_acks == 1
    assert pool.tier_copies(ticket.block_hash) == ()
    assert pool.tier_copies(ok_ticket.block_hash) == ("cpu",)


def test_ack_after_quarantine_is_dropped() -> None:
    pool = make_pool(8, 4)
    prefill(pool, "A", PROMPT)
    pool.validate_step("A")
    block = pool.block_table("A")[0]
    ticket = pool.begin_store(block, "disk")
    report = pool.invalidate([ticket.block_hash])
    assert block in report.block_ids
    assert pool.ack_store(ticket) is False
    assert pool.block_info(block).state is S.QUARANTINED


def test_unvalidated_blocks_are_not_storable() -> None:
    pool: BlockPool = make_pool(8, 4)
    prefill(pool, "A", PROMPT)
    assert pool.storable_blocks("A") == ()
