"""roll_back_blocks: an engine with its own block tables rolls blocks back to the tokens
they keep (a request resuming from its validated KV after a fault).

The dropped slots are queued for wiping at token granularity, the block is WRITTEN
again (its holder's next step rewrites and validates it), and whatever hung on its old
bytes -- a deferred publication, a tier copy in flight -- is void. A block anyone else
can see is refused, and a refused call changes nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvguard import BlockPool, BlockState
from kvguard.errors import (
    ForeignBlockError,
    PoolMisuseError,
    RollbackError,
    UnknownBlockError,
)
from kvguard.hashing import BlockHash
from kvguard.results import PublishOutcome, SlotRange

H1 = BlockHash(b"h1" * 8)


def _pool() -> BlockPool:
    return BlockPool(8, 4, check_invariants=True)


def test_a_partial_block_keeps_its_prefix_and_is_written_again() -> None:
    pool = _pool()
    a, b = pool.allocate_blocks(2, write=True)
    generation = pool.block_info(a).generation
    slots = pool.roll_back_blocks({a: 3, b: 0})
    assert slots == (SlotRange(a, 3, 4), SlotRange(b, 0, 4))
    assert pool.take_slots_to_zero() == list(slots)
    assert pool.take_slots_to_zero() == []
    assert [pool.block_state(x) for x in (a, b)] == [BlockState.WRITTEN] * 2
    assert pool.block_info(a).generation == generation + 1
    assert pool.counters().slots_zeroed == 1 + 4
    # The holder's next step rewrites them; its validation validates them.
    pool.validate_blocks([a, b])
    assert [pool.block_state(x) for x in (a, b)] == [BlockState.VALIDATED] * 2


def test_a_validated_partial_block_can_be_rolled_back() -> None:
    pool = _pool()
    (a,) = pool.allocate_blocks(1, write=True)
    pool.validate_blocks([a])
    assert pool.roll_back_blocks({a: 2}) == (SlotRange(a, 2, 4),)
    assert pool.block_state(a) is BlockState.WRITTEN


def test_a_deferred_publication_is_void() -> None:
    pool = _pool()
    (a,) = pool.allocate_blocks(1, write=True)
    assert pool.publish_block(a, H1, owner="r") is PublishOutcome.DEFERRED
    pool.roll_back_blocks({a: 0})
    pool.validate_blocks([a])
    assert pool.block_state(a) is BlockState.VALIDATED  # not published under H1
    assert pool.cached_block_id(H1) is None


def test_a_tier_copy_begun_before_is_dropped() -> None:
    """A duplicate of a published block stays VALIDATED with its hash (storable) and
    with its one holder: a copy of it may be in flight when it is rolled back."""
    pool = _pool()
    first, a = pool.allocate_blocks(2, write=True)
    pool.validate_blocks([first], publish={first: (H1, None, "r")})
    assert pool.validate_blocks([a], publish={a: (H1, None, "s")}).duplicates == (a,)
    ticket = pool.begin_store(a, "cpu")
    pool.roll_back_blocks({a: 1})
    assert pool.ack_store(ticket) is False


def test_integer_likes_are_taken() -> None:
    pool = _pool()
    (a,) = pool.allocate_blocks(1, write=True)
    assert pool.roll_back_blocks({np.int64(a): np.int32(1)}) == (SlotRange(a, 1, 4),)


@pytest.mark.parametrize(
    ("tails", "error", "message"),
    [
        ("published", RollbackError, "cannot be rolled back: only a WRITTEN or VALIDATED"),
        ("request-level", ForeignBlockError, "held by a request's block table"),
        ("keeps all", PoolMisuseError, "keeps 4 tokens: a rollback keeps fewer"),
        ("negative", PoolMisuseError, "tokens kept"),
        ("unknown", UnknownBlockError, "99"),
        ("not a mapping", PoolMisuseError, "takes a mapping {block_id: tokens kept}"),
        ("free", RollbackError, "(FREE, ref_cnt=0)"),
    ],
)
def test_refused_rollbacks_change_nothing(tails: str, error: type[Exception], message: str) -> None:
    pool = _pool()
    a, b = pool.allocate_blocks(2, write=True)
    pool.validate_blocks([b], publish={b: (H1, None, "r")})
    pool.add_request("r", list(range(6)))
    pool.lookup("r", max_tokens=0)
    (held,) = pool.allocate("r", 4)
    free = next(i for i in range(8) if pool.block_state(i) is BlockState.FREE)
    arg: object = {
        "published": {a: 1, b: 1},
        "request-level": {a: 1, held: 0},
        "keeps all": {a: 4},
        "negative": {a: -1},
        "unknown": {a: 1, 99: 0},
        "not a mapping": [(a, 1)],
        "free": {a: 1, free: 0},
    }[tails]
    before = pool.snapshot()
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        pool.roll_back_blocks(arg)  # type: ignore[arg-type]
    assert pool.snapshot() == before
    assert pool.take_slots_to_zero() == []
