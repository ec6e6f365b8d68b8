"""Cases the rest of the suite did not pin down, found by the mutation check
(``tools/mutation_check.py``): each test fails on one mutation that the other tests let
through (or caught only under some Hypothesis seeds) -- four of the compiled twins in
``kvguard/_speedups.c``, one of ``TransitionKernel.store_ack``.

The fast-path cases build a compiled and a pure-Python pool (``make_pair`` of
``test_fast_path``), run the same calls on both, and check exact expectations and that
both pools agree field by field.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvguard import BlockPool, BlockState
from kvguard.fast_path import PURE_PYTHON_ENV
from kvguard.results import PublishOutcome
from tests.test_fast_path import (
    H0,
    H1,
    H2,
    SPEEDUPS_MISSING,
    Pair,
    _diff,
    make_pair,
    observe,
    requires_speedups,
)

S = BlockState


@requires_speedups
@pytest.mark.parametrize("record_events", [False, True])
def test_validate_keeps_a_block_another_step_still_writes(
    monkeypatch: pytest.MonkeyPatch, record_events: bool
) -> None:
    """A block written by two block-level steps in flight stays WRITTEN, with one writer
    and its publication deferred, when the first of them is validated; the second
    validates and publishes it. (Catches a twin that validates a block with more than
    one writer: ``writers != 1`` weakened to ``writers < 1``.)"""
    pair = make_pair(monkeypatch, 6, record_events=record_events)
    a, b = pair.ok("allocate_blocks", 2, write=True)
    pair.ok("write_blocks", [a])  # a second step writes into a
    publish = {a: (H0, None, "o"), b: (H1, None, "o")}
    result = pair.ok("validate_blocks", [a, b], publish)
    assert (result.validated, result.published, result.duplicates) == ((b,), (b,), ())
    for pool in (pair.fast, pair.pure):
        kernel = pool._kernel
        assert [kernel.blocks[i].state for i in (a, b)] == [S.WRITTEN, S.PUBLISHED]
        assert kernel.writers == {a: 1}
        assert kernel.deferred == {a: (H0, None, "o")}
        assert dict(pool.prefix_index) == {H1: b}

    result = pair.ok("validate_blocks", [a])
    assert (result.validated, result.published, result.duplicates) == ((a,), (a,), ())
    for pool in (pair.fast, pair.pure):
        kernel = pool._kernel
        assert kernel.blocks[a].state is S.PUBLISHED
        assert (kernel.writers, kernel.deferred) == ({}, {})
        assert dict(pool.prefix_index) == {H1: b, H0: a}
        assert pool.stats().counters.blocks_published == 2


def _both_raise(
    pair: Pair, error: type[Exception], ids: list[int], publish: dict[int, Any]
) -> None:
    """``kernel.validate_held(ids, publish)`` raises ``error`` on both pools, which are
    left exactly alike (the twin declined: the Python primitive ran on both)."""
    for pool in (pair.fast, pair.pure):
        with pytest.raises(error):
            pool._kernel.validate_held(list(ids), dict(publish))
    fast, pure = observe(pair.fast), observe(pair.pure)
    assert fast == pure, _diff(fast, pure)


@requires_speedups
def test_validate_twin_declines_a_publication_tuple_of_another_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Called directly (the façade checks publications first), the kernel's
    ``validate_held`` with a publication that is not a 3-tuple: the twin declines and
    the Python primitive's unpacking raises ValueError, on both pools alike. (Catches a
    twin that accepts a longer tuple: ``size != 3`` weakened to ``size < 3``.)"""
    pair = make_pair(monkeypatch, 6, record_events=False)
    a, b, c = pair.ok("allocate_blocks", 3, write=True)
    _both_raise(pair, ValueError, [a, b], {b: (H0, None, "o", "extra")})
    for pool in (pair.fast, pair.pure):
        kernel = pool._kernel
        # The Python primitive validated a, then stopped at b's publication.
        assert [kernel.blocks[i].state for i in (a, b)] == [S.VALIDATED, S.VALIDATED]
        assert kernel.blocks[b].block_hash is None
        assert dict(pool.prefix_index) == {}
    _both_raise(pair, ValueError, [c], {c: (H2, None)})
    for pool in (pair.fast, pair.pure):
        assert pool._kernel.blocks[c].state is S.VALIDATED
        assert dict(pool.prefix_index) == {}


@requires_speedups
def test_validate_twin_declines_a_publication_whose_hash_is_not_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Called directly, the kernel's ``validate_held`` with an unhashable publication
    hash: the twin declines before it changes anything, so the Python primitive stops
    at that block exactly as a pure-Python pool does -- the later block keeps its writer.
    (Catches a twin that does not check that the hash is bytes: it would take the later
    block's writer in its checking pass, then stop half-way.)"""
    pair = make_pair(monkeypatch, 6, record_events=False)
    a, b = pair.ok("allocate_blocks", 2, write=True)
    _both_raise(pair, TypeError, [a, b], {a: ([1], None, "o")})
    for pool in (pair.fast, pair.pure):
        kernel = pool._kernel
        assert kernel.blocks[b].state is S.WRITTEN
        assert kernel.writers == {b: 1}
        assert dict(pool.prefix_index) == {}


@requires_speedups
@pytest.mark.parametrize("record_events", [False, True])
def test_validate_forgets_the_deferred_publications_it_carries_out(
    monkeypatch: pytest.MonkeyPatch, record_events: bool
) -> None:
    """Blocks published while still being written (``publish_block``: DEFERRED) are
    published by the validation of their step -- the call's own publication, where it
    gives one, instead of the recorded one -- and the pool forgets both records.
    (Catches a twin that leaves a carried-out publication in the deferred table.)"""
    pair = make_pair(monkeypatch, 6, record_events=record_events)
    a, b = pair.ok("allocate_blocks", 2, write=True)
    assert pair.ok("publish_block", a, H0, owner="o") is PublishOutcome.DEFERRED
    assert pair.ok("publish_block", b, H1, owner="o") is PublishOutcome.DEFERRED
    for pool in (pair.fast, pair.pure):
        assert pool._kernel.deferred == {a: (H0, None, "o"), b: (H1, None, "o")}
    result = pair.ok("validate_blocks", [a, b], {b: (H2, H0, "p")})
    assert (result.validated, result.published, result.duplicates) == ((a, b), (a, b), ())
    for pool in (pair.fast, pair.pure):
        kernel = pool._kernel
        assert kernel.deferred == {}
        assert kernel.writers == {}
        assert [
            (x.state, x.block_hash, x.parent_hash) for x in (kernel.blocks[a], kernel.blocks[b])
        ] == [
            (S.PUBLISHED, H0, None),
            (S.PUBLISHED, H2, H0),
        ]
        assert dict(pool.prefix_index) == {H0: a, H2: b}
        counters = pool.stats().counters
        assert (counters.blocks_published, counters.deferred_publications) == (2, 3)


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "C"])
def test_late_ack_of_a_reused_block_republished_under_the_same_hash_is_dropped(
    monkeypatch: pytest.MonkeyPatch, compiled: bool
) -> None:
    """A copy started before the block was evicted and reused: the block is PUBLISHED
    again under the very same hash, but its generation moved on, so the late
    acknowledgement is dropped (``ack_store`` False, counted) and the block stays
    PUBLISHED, with no tier copy recorded. (Catches a ``store_ack`` that checks the hash
    and state but not the generation.)"""
    if compiled and SPEEDUPS_MISSING is not None:
        pytest.skip(f"kvguard._speedups is not built ({SPEEDUPS_MISSING})")
    if compiled:
        monkeypatch.delenv(PURE_PYTHON_ENV, raising=False)
    else:
        monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    pool = BlockPool(1, 4, check_invariants=True)
    assert pool._kernel.compiled is compiled
    (x,) = pool.allocate_blocks(1, write=True)
    assert pool.validate_blocks([x], {x: (H0, None, "o")}).published == (x,)
    ticket = pool.begin_store(x)
    pool.release_blocks([x])
    assert pool.allocate_blocks(1, write=True) == [x]  # evicted and handed out again
    assert pool.validate_blocks([x], {x: (H0, None, "o")}).published == (x,)
    block = pool._kernel.blocks[x]
    assert (block.state, block.block_hash, block.generation) == (
        S.PUBLISHED,
        H0,
        ticket.generation + 1,
    )

    assert pool.ack_store(ticket) is False
    assert block.state is S.PUBLISHED
    assert pool.tier_copies(H0) == ()
    counters = pool.stats().counters
    assert (counters.dropped_acks, counters.stores_acknowledged) == (1, 0)
