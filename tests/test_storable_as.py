"""The storable rule (``TierGate.storable_as``) and the exit epoch exits trust it by.

A block may leave as a key only when it is VALIDATED or later and carries that key; the
exit epoch moves whenever a block someone holds may have stopped being storable.
"""

from __future__ import annotations

import pytest

from kvguard import BlockPool
from kvguard.errors import PoolMisuseError, UnknownBlockError
from kvguard.hashing import BlockHash

H1 = BlockHash(b"h1" * 8)
H2 = BlockHash(b"h2" * 8)


def _published(pool: BlockPool, key: BlockHash = H1) -> int:
    (b,) = pool.allocate_blocks(1)
    pool.write_blocks([b])
    pool.publish_block(b, key, owner="r1")
    pool.validate_blocks([b])
    return b


def test_storable_only_validated_under_its_key() -> None:
    pool = BlockPool(6, 4, check_invariants=True)
    gate = pool.tier_gate
    (b,) = pool.allocate_blocks(1)
    assert not gate.storable_as(b, H1)  # ALLOCATED
    pool.write_blocks([b])
    pool.publish_block(b, H1, owner="r1")
    assert not gate.storable_as(b, H1)  # WRITTEN, its publication deferred
    pool.validate_blocks([b])
    assert gate.storable_as(b, H1)  # PUBLISHED under H1
    assert not gate.storable_as(b, H2)  # another request's key at that position
    ticket = pool.begin_store(b, "cpu")
    assert pool.ack_store(ticket)
    assert gate.storable_as(b, H1)  # OFFLOADED


def test_validated_without_a_hash_is_not_storable() -> None:
    pool = BlockPool(6, 4, check_invariants=True)
    (b,) = pool.allocate_blocks(1)
    pool.write_blocks([b])
    pool.validate_blocks([b])  # VALIDATED, never published: no key
    assert not pool.tier_gate.storable_as(b, H1)


def test_quarantined_is_not_storable_and_moves_the_epoch() -> None:
    pool = BlockPool(6, 4, check_invariants=True)
    gate = pool.tier_gate
    b = _published(pool)
    epoch = gate.exit_epoch()
    assert gate.exit_epoch() == epoch  # a pure read
    pool.invalidate([H1])
    assert not gate.storable_as(b, H1)
    assert gate.exit_epoch() != epoch


def test_eviction_leaves_the_epoch_and_takes_only_unheld_blocks() -> None:
    # An exit trusts a frontier it verified while the epoch stays and the request holds
    # the blocks: an eviction needs no epoch move, since it never takes a held block.
    pool = BlockPool(3, 4, check_invariants=True)
    held = _published(pool)
    freed = _published(pool, H2)
    pool.release_blocks([freed], steps_passed=True)  # cached, no holder
    epoch = pool.tier_gate.exit_epoch()
    taken = pool.allocate_blocks(pool.get_num_free_blocks())  # takes the cached one back
    assert freed in taken and held not in taken
    assert not pool.tier_gate.storable_as(freed, H2)
    assert pool.tier_gate.storable_as(held, H1)
    assert pool.tier_gate.exit_epoch() == epoch


def test_a_failed_step_moves_the_epoch() -> None:
    pool = BlockPool(6, 4, check_invariants=True)
    epoch = pool.tier_gate.exit_epoch()
    (b,) = pool.allocate_blocks(1)
    pool.write_blocks([b])
    pool.fail_blocks([b])
    assert pool.tier_gate.exit_epoch() != epoch


@pytest.mark.parametrize("bad", [-1, 99, "0", None])
def test_bad_block_id_is_a_typed_error(bad: object) -> None:
    pool = BlockPool(6, 4)
    with pytest.raises(UnknownBlockError):
        pool.tier_gate.storable_as(bad, H1)  # type: ignore[arg-type]


def test_bad_key_is_a_typed_error() -> None:
    pool = BlockPool(6, 4)
    with pytest.raises(PoolMisuseError):
        pool.tier_gate.storable_as(1, "not bytes")  # type: ignore[arg-type]
