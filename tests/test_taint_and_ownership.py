"""Taint reaches what was computed on tainted KV; hits and block-level calls stay with
their owner. Each test is a defect a user found through the public API."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvguard import (
    BlockHash,
    BlockPool,
    BlockState,
    ForeignBlockError,
    NotStorableError,
    PoolMisuseError,
    PrefixHit,
    RequestAborted,
    RequestAbortedError,
    StaleHitError,
    StepOutcome,
)
from kvguard.fast_path import PURE_PYTHON_ENV, available
from kvguard.transition_kernel import TransitionKernel

from .conftest import make_pool

S = BlockState
P = list(range(12))
H = [BlockHash(bytes([i]) * 16) for i in range(4)]


@pytest.fixture(params=["C", "python"])
def flavour(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Block-level tests run with the compiled fast paths and in pure Python."""
    if request.param == "C":
        monkeypatch.delenv(PURE_PYTHON_ENV, raising=False)
        if not available():
            pytest.skip("kvguard._speedups is not built")
    else:
        monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    yield request.param


def hash_of(p: BlockPool, block_id: int) -> BlockHash:
    block_hash = p.block_hash(block_id)
    assert block_hash is not None, f"block {block_id} has no hash"
    return block_hash


def block_pool(num_blocks: int = 16, *, record_events: bool = False) -> BlockPool:
    return BlockPool(num_blocks, 4, record_events=record_events, check_invariants=True)


# ------------------------------------------------------------------ taint


def test_descendants_of_a_tainted_prefix_never_become_hits() -> None:
    p = make_pool(32, 4)
    p.add_request("a", P)
    p.allocate("a", 12)
    p.write("a", 4)
    p.validate_step("a")
    report = p.invalidate([hash_of(p, p.block_table("a")[0])])
    assert report.requests == ("a",) and p.progress("a").aborted
    events = p.take_events()
    assert RequestAborted("a", 0, (p.block_table("a")[0],)) in events
    with pytest.raises(RequestAbortedError):
        p.write("a", 8)  # nothing it computes on the tainted block can be published
    p.add_request("z", P[:4] + [99])
    p.allocate("z", 5)
    p.write("z", 5)
    p.validate_step("z")
    p.add_request("y", P)
    assert p.lookup("y").block_ids == (p.block_table("z")[0],)


def test_steps_in_flight_on_a_tainted_block_are_discarded() -> None:
    p = make_pool(32, 4)
    p.add_request("a", P)
    p.allocate("a", 12)
    p.write("a", 4)
    p.validate_step("a")
    p.write("a", 8)  # in flight, attending to block 0
    p.invalidate([hash_of(p, p.block_table("a")[0])])
    assert p.validate_step("a").outcome is StepOutcome.DISCARDED
    assert [p.block_state(b) for b in p.block_table("a")] == [S.QUARANTINED] * 3
    assert p.prefix_index == {}


def test_rollback_resumes_a_tainted_request_from_before_the_taint() -> None:
    p = make_pool(32, 4)
    p.add_request("a", P)
    p.allocate("a", 12)
    p.write("a", 12)
    p.validate_step("a")
    table = p.block_table("a")
    p.invalidate([hash_of(p, table[1])], descendants=False)
    # Block 2 was computed by "a" on the tainted block 1: tainted too, descendants or not.
    assert [p.block_state(b) for b in table] == [S.PUBLISHED, S.QUARANTINED, S.QUARANTINED]
    assert p.progress("a").num_validated_tokens == 4
    rollback = p.zero_request_tail("a")
    assert rollback.num_tokens == 4 and not p.progress("a").aborted
    p.write("a", 8)  # recomputed afresh on the sound prefix
    assert len(p.validate_step("a").published) == 2
    p.add_request("y", P)
    assert p.lookup("y").num_tokens == 12


def test_taint_follows_shared_blocks_to_every_holder() -> None:
    p = make_pool(32, 4)
    p.add_request("a", P)
    p.allocate("a", 12)
    p.write("a", 12)
    p.validate_step("a")
    p.add_request("b", P + [50, 51, 52, 53])
    hit = p.lookup("b")
    assert hit.num_tokens == 12
    p.allocate("b", 16, hit=hit)
    p.write("b", 4)
    p.validate_step("b")  # block 3 of b, computed on a's blocks
    p.add_request("c", P[:4])
    p.allocate("c", 4, hit=p.lookup("c"))  # holds block 0 only: untouched
    report = p.invalidate([hash_of(p, p.block_table("a")[1])], descendants=False)
    assert set(report.requests) == {"a", "b"}
    assert not p.progress("c").aborted
    assert [p.block_state(b) for b in p.block_table("b")] == [S.PUBLISHED] + [S.QUARANTINED] * 3
    p.add_request("y", P + [50, 51, 52, 53])
    assert p.lookup("y").num_tokens == 4


def test_caller_given_hashes_chained_on_a_tainted_hash_are_not_published() -> None:
    p = make_pool(32, 4)
    p.add_request("e", block_hashes=H[:2])
    p.allocate("e", 8)
    p.write("e", 4)
    p.validate_step("e")
    p.invalidate([H[0]])
    with pytest.raises(RequestAbortedError):
        p.write("e", 4)
    # Another request names the same chain, and its block 0 is what it computed afresh.
    p.add_request("f", block_hashes=H[:2])
    assert p.lookup("f").num_tokens == 0
    p.allocate("f", 8)
    p.write("f", 8)
    assert len(p.validate_step("f").published) == 2


def test_block_level_publications_chained_on_a_tainted_hash_are_refused(flavour: str) -> None:
    p = block_pool()
    b0, b1, b2 = p.allocate_blocks(3, write=True)
    p.validate_blocks([b0], {b0: (H[0], None, "r")})
    assert p.publish_block(b1, H[1], H[0], owner="r").name == "DEFERRED"
    p.invalidate([H[0]], descendants=False)
    # b1's step was in flight, attending to b0; b2's is chained on b1's hash.
    validation = p.validate_blocks([b1, b2], {b2: (H[2], H[1], "r")})
    assert validation.published == ()
    assert p.block_hash(b1) is None and p.block_hash(b2) is None
    assert p.stats().counters.tainted_publications_refused == 2
    with pytest.raises(NotStorableError):
        p.begin_store(b1)
    # Computed afresh elsewhere: the hash is sound again, and so is its chain.
    c0, c1 = p.allocate_blocks(2, write=True)
    assert p.validate_blocks([c0, c1], {c0: (H[0], None, "s"), c1: (H[1], H[0], "s")}).published
    assert p.cached_block_id(H[1]) == c1


# ------------------------------------------------------------------ prefix hits


def _published(p: BlockPool) -> None:
    p.add_request("A", P)
    p.allocate("A", 12)
    p.write("A", 12)
    p.validate_step("A")


def test_a_hit_does_not_outlive_its_request_id() -> None:
    p = make_pool(32, 4)
    _published(p)
    p.add_request("B", P)
    old = p.lookup("B")
    assert old.num_tokens == 12
    p.free("B")
    p.add_request("B", [7] * 12)
    before = p.snapshot()
    with pytest.raises(StaleHitError):
        p.allocate("B", 12, hit=old)
    with pytest.raises(StaleHitError):
        p.can_allocate("B", 12, hit=old)
    assert p.snapshot() == before


def test_forged_and_foreign_hits_are_refused() -> None:
    p = make_pool(32, 4)
    _published(p)
    other = make_pool(32, 4)
    _published(other)
    p.add_request("B", P)
    other.add_request("B", P)
    hit = p.lookup("B")
    blocks = hit.block_ids
    bad = [
        (other.lookup("B"), StaleHitError),  # another pool's
        (dataclasses.replace(hit), StaleHitError),  # a copy
        (dataclasses.replace(hit, block_ids=(blocks[1], blocks[0], blocks[2])), StaleHitError),
        (dataclasses.replace(hit, block_ids=(99,) + blocks[1:]), StaleHitError),
        (dataclasses.replace(hit, num_tokens=8), StaleHitError),
        (PrefixHit("B", blocks, hit.generations, 12), StaleHitError),  # built by hand
        (dataclasses.replace(hit, request_id="A"), PoolMisuseError),
        ("not a hit", PoolMisuseError),
    ]
    for forged, error in bad:
        before = p.snapshot()
        with pytest.raises(error):
            p.allocate("B", 12, hit=forged)  # type: ignore[arg-type]
        assert p.snapshot() == before, forged
    p.allocate("B", 12, hit=hit)  # the real one still works
    assert p.block_table("B") == blocks


# ------------------------------------------------------------------ ownership


def test_block_level_calls_refuse_blocks_a_request_holds(flavour: str) -> None:
    p = BlockPool(16, 4, check_invariants=True)
    p.add_request("r", P)
    p.allocate("r", 12)
    p.write("r", 6)  # blocks 0-1 WRITTEN, block 2 ALLOCATED
    p.validate_step("r")  # block 0 PUBLISHED, block 1 VALIDATED (partial)
    p.write("r", 2)  # block 1 WRITTEN again
    table = p.block_table("r")
    p.validate_step("r")  # block 1 VALIDATED, full now and published
    p.write("r", 1)  # block 2 WRITTEN
    calls: list[Callable[[], object]] = [
        lambda: p.publish_block(table[2], H[3], None),  # WRITTEN
        lambda: p.fail_blocks([table[2]]),
        lambda: p.validate_blocks([table[2]]),
        lambda: p.write_blocks([table[2]]),
        lambda: p.release_blocks([table[2]]),
    ]
    for call in calls:
        before = p.snapshot()
        with pytest.raises(ForeignBlockError):
            call()
        assert p.snapshot() == before
    p.validate_step("r")  # the request goes on as if nothing happened
    assert p.block_state(table[2]) is S.VALIDATED
    with pytest.raises(ForeignBlockError):  # a partial VALIDATED block of a request
        p.publish_block(table[2], H[3], None)
    p.add_request("q", [5] * 8)
    p.allocate("q", 8)  # ALLOCATED blocks of a request
    with pytest.raises(ForeignBlockError):
        p.publish_block(p.block_table("q")[0], H[3], None)
    p.check_invariants()


def test_malformed_publications_are_refused_with_and_without_c(flavour: str) -> None:
    p = block_pool()
    a, b = p.allocate_blocks(2, write=True)
    for publication in [
        (b"h" * 8, 123, 456),  # parent and owner of the wrong type
        (b"h" * 8, None, 456),
        (b"h" * 8, "parent", "r"),
        ("hash", None, "r"),
        (b"h" * 8, None),
        [b"h" * 8, None, "r"],
    ]:
        before = p.snapshot()
        with pytest.raises(PoolMisuseError):
            p.validate_blocks([a, b], {a: publication})  # type: ignore[dict-item]
        with pytest.raises(PoolMisuseError):
            p.validate_blocks([a, b], {99: publication})  # type: ignore[dict-item]
        assert p.snapshot() == before, publication
    assert p.validate_blocks([a, b], {a: (BlockHash(b"h" * 8), None, "r")}).published == (a,)


# ------------------------------------------------------------------ recovery


def test_an_empty_rollback_keeps_the_known_token_ids() -> None:
    p = make_pool(16, 4)
    p.add_request("r", P[:4])
    p.allocate("r", 8)
    p.write("r", 4)
    p.validate_step("r")
    p.append_tokens("r", [40, 41, 42])  # sampled and the next chunk: known, not written
    before = p.snapshot()
    rollback = p.zero_request_tail("r", 0)
    assert rollback.num_tokens == 4 and rollback.slots == ()
    assert p.snapshot() == before


def test_the_compiled_validation_still_serves_sound_publications_after_a_taint(
    flavour: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once any hash is tainted, only publications of a tainted hash or one chained on
    it leave the C path (a vLLM engine that saw one failed KV load keeps its speed)."""
    if flavour != "C":
        pytest.skip("about the compiled path")
    p = block_pool()
    python_paths: list[list[int]] = []
    slow = TransitionKernel._validate_and_publish

    def counted(self: TransitionKernel, ids: list[int], publish: Any) -> Any:
        python_paths.append(list(ids))
        return slow(self, ids, publish)

    monkeypatch.setattr(TransitionKernel, "_validate_and_publish", counted)
    b0, b1, b2, b3 = p.allocate_blocks(4, write=True)
    p.validate_blocks([b0], {b0: (H[0], None, "r")})
    assert python_paths == []  # C
    p.invalidate([H[0]], descendants=False)
    p.validate_blocks([b1], {b1: (H[3], None, "r")})  # unrelated to the taint: C
    assert python_paths == [] and p.cached_block_id(H[3]) == b1
    p.validate_blocks([b2], {b2: (H[1], H[0], "r")})  # chained on the tainted hash
    assert python_paths == [[b2]] and p.block_hash(b2) is None
    p.validate_blocks([b3], {b3: (H[0], None, "s")})  # the tainted hash, afresh
    assert python_paths == [[b2], [b3]] and p.cached_block_id(H[0]) == b3
