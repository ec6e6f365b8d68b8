"""Seals in the pool: recorded when a block's step validates, held while the block keeps
those bytes, carried by its store tickets and kept by the tier copies they record."""

from __future__ import annotations

import pytest

from kvguard import BlockPool, PoolMisuseError
from kvguard.hashing import BlockHash

H1, H2 = BlockHash(b"\x01" * 16), BlockHash(b"\x02" * 16)


def pool_with_written(n: int = 3) -> tuple[BlockPool, list[int]]:
    pool = BlockPool(8, 4)
    ids = pool.allocate_blocks(n, write=True)
    return pool, ids


def test_a_validation_records_each_blocks_seal() -> None:
    pool, (a, b, c) = pool_with_written()
    pool.validate_blocks([a, b, c], publish={a: (H1, None, "r")}, seals={a: 11, b: -5})
    assert [pool.block_seal(x) for x in (a, b, c)] == [11, -5, None]  # c: validated unsealed
    assert pool.counters().blocks_sealed == 2
    pool.check_invariants()


def test_a_seal_goes_with_the_bytes_it_fingerprints() -> None:
    pool, (a, b, c) = pool_with_written()
    pool.validate_blocks([a, b, c], publish={a: (H1, None, "r")}, seals={a: 1, b: 2, c: 3})
    # b is written again (a new step) and validated without a seal: its old one is void.
    pool.write_blocks([b])
    assert pool.block_seal(b) is None  # WRITTEN: not the sealed bytes any more
    pool.validate_blocks([b])
    assert pool.block_seal(b) is None
    # c is released: its next owner's bytes are another matter.
    pool.release_blocks([c])
    (again,) = pool.allocate_blocks(1, write=True)
    assert pool.block_seal(c) is None and pool.block_seal(again) is None
    # a, published, keeps its seal while cached and held.
    assert pool.block_seal(a) == 1


def test_a_block_another_step_still_writes_is_not_sealed_yet() -> None:
    pool, (a, _, _) = pool_with_written()
    pool.write_blocks([a])  # a second step writes a too
    pool.validate_blocks([a], seals={a: 7})  # the first: a still WRITTEN
    assert pool.block_seal(a) is None
    pool.validate_blocks([a], seals={a: 8})  # the second: its seal counts
    assert pool.block_seal(a) == 8


def test_a_tier_copy_carries_the_seal_of_its_block() -> None:
    pool, (a, b, _) = pool_with_written()
    pool.validate_blocks([a, b], publish={a: (H1, None, "r"), b: (H2, H1, "r")}, seals={a: 41})
    sealed, unsealed = pool.begin_store(a, "cpu"), pool.begin_store(b, "cpu")
    assert (sealed.seal, unsealed.seal) == (41, None)
    assert pool.ack_store(sealed) and pool.ack_store(unsealed)
    assert pool.tier_seal(H1, "cpu") == 41
    assert pool.tier_seal(H2, "cpu") is None
    assert pool.tier_seal(H1, "disk") is None  # no copy there
    pool.check_invariants()
    # The copy goes (evicted by its tier, or purged): so does its seal.
    assert pool.forget_tier_copy("cpu", H1)
    assert pool.tier_seal(H1, "cpu") is None
    ticket = pool.begin_store(a, "cpu")
    pool.ack_store(ticket)
    pool.invalidate([H1])
    assert pool.tier_seal(H1, "cpu") is None
    pool.check_invariants()


def test_a_late_acknowledgement_records_no_seal() -> None:
    pool, (a, _, _) = pool_with_written()
    pool.validate_blocks([a], publish={a: (H1, None, "r")}, seals={a: 5})
    ticket = pool.begin_store(a, "cpu")
    pool.invalidate([H1])  # the block is quarantined while its copy runs
    assert not pool.ack_store(ticket)
    assert pool.tier_seal(H1, "cpu") is None


@pytest.mark.parametrize(
    "seals",
    [[1], {1.5: 2}, {True: 2}, {0: "x"}, {0: 1 << 63}, {0: None}, "seals"],
    ids=repr,
)
def test_bad_seals_are_refused_and_change_nothing(seals: object) -> None:
    pool, (a, _, _) = pool_with_written()
    before = pool.snapshot()
    with pytest.raises(PoolMisuseError, match="seal"):
        pool.validate_blocks([a], seals=seals)  # type: ignore[arg-type]
    assert pool.snapshot() == before


def test_a_request_steps_validation_records_its_blocks_seals() -> None:
    """The request-level form: ``validate_step(rid, seals=...)`` seals the blocks the
    step covers; the next step's validation of a partial block replaces its seal."""
    pool = BlockPool(8, 4)
    pool.add_request("r", list(range(10)))
    pool.allocate("r", 10, hit=pool.lookup("r"))
    pool.write("r", 6)
    a, b, c = pool.block_table("r")
    pool.validate_step("r", seals={a: 1, b: 2, c: 3})  # c: not written yet, not covered
    assert [pool.block_seal(x) for x in (a, b, c)] == [1, 2, None]
    pool.write("r", 4)
    pool.validate_step("r", seals={c: 30})  # b written again (tokens 4..7): unsealed now
    assert [pool.block_seal(x) for x in (a, b, c)] == [1, None, 30]
    assert pool.begin_store(a, "cpu").seal == 1  # full, published: its copies carry it
    pool.check_invariants()
