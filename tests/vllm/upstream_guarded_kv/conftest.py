"""vLLM 0.34's own KV-cache tests for Mamba, hybrid and partial-block groups, run a second
time on kvguard's guarded pool.

The modules here collect the vendored KV-cache tests of ``tests/vllm/upstream/v0_34/``
(``test_prefix_caching.py``, ``test_single_type_kv_cache_manager.py``,
``test_partial_prefix_cache_primitives.py``) again, each test unmodified, and run those
:func:`selected` picks (the others are deselected): every test of the partial-block
primitives module, and in the other two the tests whose name says they concern Mamba
state groups, hybrid (several-group) KV caches, partial-block hashing or cross-attention
(:data:`SELECTED_NAMES`; vLLM 0.34 has no KV-cache test of a cross-attention group),
HiSparse ones excepted (refused groups). Tests of one sliding-window or full-attention
group named otherwise are not selected; a few selected ones build no pool at all
(``reachable_block_mask`` classmethods, ``KVCacheBlocks``) and pass as on stock vLLM.
They run "given clean outputs" (:mod:`.guard`):

- every ``KVCacheManager`` a vendored test or helper builds runs on kvguard's pool
  (``install_guarded_pool``, the guard on, kvguard's pool checked after every change);
  a ``BlockPool`` a test builds itself is kvguard's ``GuardedBlockPool``, and a
  single-type manager it builds on one is wired to it as a ``KVCacheManager``'s are;
- each call that caches blocks (``allocate_slots``, ``cache_blocks``; a test's own
  ``cache_full_blocks`` / ``cache_partial_block``) is a step whose output came back
  clean once it returns: what kvguard held back for it is validated then;
- a request's blocks vLLM releases in ``free`` and ``remove_skipped_blocks`` are
  released as after clean steps (a guarded scheduler's ``steps_passed=True``).

A test that passes on stock vLLM and fails here shows where the guarded pool differs
from vLLM's with clean steps; each is an expected failure (strict, with the exception
and the message it fails with: tests/vllm/upstream/expected_failure.py) listed in
:data:`EXPECTED_FAILURES`, grouped by why. The stock run's skips (``SKIPPED`` in
tests/vllm/upstream/conftest.py) apply here too.

Run: ``HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu python -m pytest tests/vllm/upstream_guarded_kv``
(vLLM 0.34 only; on another series each module here is skipped, as the vendored ones
are).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from kvguard.adapters.vllm.pool.block_pool import GuardModeUnsupported
from tests.vllm.upstream import conftest as upstream
from tests.vllm.upstream.expected_failure import ExpectedFailure

from .guard import guard_vendored_modules

# vLLM's markers, for a run of this folder alone.
pytest_configure = upstream.pytest_configure

_HERE = "tests/vllm/upstream_guarded_kv/"

SELECTED_MODULES = ("test_partial_prefix_cache_primitives.py",)
"""Modules run whole: vLLM's tests of partial-block prefix caching (``hash_block_size <
block_size``, ``BlockPool.cache_partial_block``)."""

SELECTED_NAMES = re.compile(
    r"mamba|checkpoint"  # Mamba / Mamba-align state groups, their prefill checkpoints
    r"|hybrid|(multi|multiple|two|three|all|each|per)_groups?(_|$)|different_block_size"
    # ^ hybrid models: several KV cache groups (full attention + sliding window + Mamba)
    r"|fine_grained|finer_hash"  # partial-block hashing: hash_block_size < block_size
    r"|cross_attention"  # cross-attention groups (vLLM 0.34's KV-cache tests have none)
)
"""In the other modules (test_prefix_caching.py, test_single_type_kv_cache_manager.py),
the tests whose name says they concern those groups."""

NOT_SELECTED = re.compile(r"hisparse")
"""HiSparse groups: refused by the guard at install time, by design
(``REFUSED_MANAGERS``), not a group this folder is about."""


def selected(key: str) -> bool:
    """Whether the test ``module::name`` (no parameters) runs here."""
    module, name = key.split("::", 1)
    if NOT_SELECTED.search(name):
        return False
    return module in SELECTED_MODULES or bool(SELECTED_NAMES.search(name))


_PARTIAL = "test_partial_prefix_cache_primitives.py::"
_PREFIX = "test_prefix_caching.py::"
_SINGLE = "test_single_type_kv_cache_manager.py::"

_TAIL_HELD = (
    "kvguard holds an entry vLLM registers inside a block (cache_partial_block at a "
    "prefix that ends inside the block: a partial tail, hash_block_size < block_size) "
    "until the request releases the block after clean steps "
    "(GuardedBlockPool.cache_partial_block, .tails): its request goes on writing the "
    "block, and kvguard publishes a block only once no step changes it. The test expects "
    "the entry {} right after cache_partial_block returned (its full blocks, validated "
    "when cache_full_blocks returned, are matchable as on stock vLLM)."
)

_NOT_MATCHABLE = r"^assert None == \[GuardedKVCacheBlock\("
"""vLLM's assertion: get_cached_block finds no block for the entry's key."""

HELD_TAILS: dict[str, ExpectedFailure] = {
    # module::test, or module::test[params] for some parametrizations only
    # -> (what it fails with, its message, why)
    **{
        f"{_PARTIAL}{test}": ExpectedFailure(
            AssertionError,
            r"^assert 0 == 1\s+\+\s+where 0 = len\(\[\]\)",  # (no event)
            _TAIL_HELD.format("published (a BlockStored event)"),
        )
        for test in (
            "test_cache_partial_block_kv_cache_events",
            "test_cache_partial_block_event_keeps_every_mm_feature",
        )
    },
    **{
        f"{_PARTIAL}{test}": ExpectedFailure(
            AssertionError, _NOT_MATCHABLE, _TAIL_HELD.format("matchable (get_cached_block)")
        )
        for test in (
            "test_partial_block_replacement_emits_remove_then_store_events",
            "test_later_request_hits_cached_partial_tail",
            "test_cache_partial_block_uses_fine_grained_boundary_hash",
            "test_reset_prefix_cache_clears_partial_entry_metadata",
            "test_evict_cached_block_removes_full_hash_and_partial_entry",
            "test_partial_block_promotes_to_direct_full_block_hash",
        )
    },
}
"""Partial-block entries, which kvguard publishes later than vLLM by design."""

LATER_PUBLICATION: dict[str, ExpectedFailure] = {
    f"{_PREFIX}test_mamba_boundary_handoffs_do_not_pin_obsolete_blocks": ExpectedFailure(
        KeyError,
        r"^'request'$",  # (the test's offers[request.request_id]: none offered)
        "MambaManager.cache_blocks offers a KV connector each Mamba state it caches "
        "(take_boundary_state_offloads), skipping the blocks that have no hash when "
        "cache_full_blocks returns: kvguard gives a block its key once the step that "
        "filled it validated (here: when allocate_slots returned), so no state is "
        "offered and the request has no entry (a known limitation, docs/vllm-reference.md: hybrid "
        "models' states are not offloaded)",
    ),
    f"{_PREFIX}test_block_stored_event_group_idx_multiple_groups": ExpectedFailure(
        AssertionError,
        r"^assert 4 == 2\s+\+\s+where 4 = len\(\[BlockStored\(",
        "kvguard emits one BlockStored per block, as each is published "
        "(tests/vllm/test_kv_events.py), where vLLM emits one per cache_full_blocks call: "
        "4 events for the test's 2 calls of 2 blocks (each with the group_idx, spec kind "
        "and sliding window the test expects of its call's event)",
    ),
}
"""Publication that differs from vLLM's by design (when, and how it is reported)."""

_PREFIX_INDEX = (
    "{} vLLM's prefix index (BlockPool.cached_block_hash_to_block{}) directly: kvguard's "
    "pool keeps its own prefix index, and vLLM's map, still built by BlockPool.__init__, "
    "stays empty and unread. {}"
)

INTERNALS: dict[str, ExpectedFailure] = {
    **{
        f"{_PREFIX}{test}": ExpectedFailure(
            KeyError,
            # (the key popped: a block hash of group 1, in vLLM's empty map)
            r"^b(['\"]).*\\x00\\x00\\x00\\x01\1$",
            _PREFIX_INDEX.format(
                "Evicts a hit by popping from",
                "._cache, _test_partial_request_hit",
                "Every hit it checks before that is the one stock vLLM gives; with its "
                "evictions done on kvguard's index instead (those keys hidden from the "
                "pool's lookup), the test passes.",
            ),
        )
        for test in ("test_prefill_hybrid_model", "test_prefill_hybrid_model_eagle")
    },
    f"{_PREFIX}test_different_block_size": ExpectedFailure(
        AssertionError,
        r"^assert 3 == 2\s+\+\s+where 3 = len\(\[GuardedKVCacheBlock\(",
        _PREFIX_INDEX.format(
            "Evicts two sliding-window hits with",
            ".pop",
            "Nothing is evicted, so the hit stays at 6 blocks; the hits before that are "
            "stock vLLM's, and with the eviction done on kvguard's index instead (those "
            "keys hidden from the pool's lookup), the test passes.",
        ),
    ),
    f"{_SINGLE}test_sliding_window_cache_hit_with_finer_hash_alignment": ExpectedFailure(
        AssertionError,
        r"^assert 0 == 8\b",
        _PREFIX_INDEX.format(
            "Seeds its cache hits by inserting into",
            ".insert",
            "kvguard's lookup finds no hit (hit length 0).",
        ),
    ),
    **{
        f"{_PREFIX}{test}": ExpectedFailure(
            GuardModeUnsupported,
            r"^free_block_queue\.fake_free_list_head: in guarded mode kvguard owns the free queue",
            "walks vLLM's free list by its links "
            "(block_pool.free_block_queue.fake_free_list_head, _take_free_blocks) for "
            "blocks to stand in for evictable hits: kvguard's pool owns the free queue, "
            "and its free_block_queue refuses the linked list's links. (The stand-ins "
            "are free blocks no step ever published: taken from kvguard's free queue "
            "instead, touch() refuses them as hits, IllegalTransitionError, ACQUIRE from "
            "FREE -- only published blocks are prefix hits.)",
        )
        for test in (
            "test_cache_hit_local_and_external_three_groups",
            "test_cache_hit_local_and_external_three_groups_preempt_and_reallocate",
            "test_cache_hit_local_and_external_two_groups_preempt_and_reallocate",
        )
    },
    f"{_PREFIX}test_cache_blocks_multi_group": ExpectedFailure(
        AttributeError,
        r"^'KVCacheBlock' object has no attribute 'state'$",
        "hands cache_full_blocks block objects it built itself (KVCacheBlock(block_id=i)), "
        "not blocks the pool handed out: kvguard's pool caches only its own block "
        "records, whose state it reads (vLLM's KVCacheBlock has no state)",
    ),
}
"""Tests that reach past the pool's interface into what kvguard's pool replaces, or
whose calls kvguard's pool answers differently."""

EXPECTED_FAILURES = {**HELD_TAILS, **LATER_PUBLICATION, **INTERNALS}


@pytest.fixture(autouse=True)
def guarded(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The vendored KV-cache modules build kvguard's guarded pool and managers."""
    guard_vendored_modules(monkeypatch)
    yield


def pytest_itemcollected(item: pytest.Item) -> None:
    # kvguard's `vllm` marker (CI selects ``-m vllm``), as for the vendored modules.
    if _HERE in item.path.as_posix() and item.get_closest_marker("vllm") is None:
        item.add_marker(pytest.mark.vllm)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept, deselected = [], []
    for item in items:
        if _HERE not in item.path.as_posix():
            kept.append(item)
            continue
        # "tests/vllm/upstream_guarded_kv/test_x.py::test_f[p]" -> "test_x.py::test_f[p]"
        key = item.nodeid.split(_HERE, 1)[-1]
        test = key.split("[", 1)[0]
        if not selected(test):
            deselected.append(item)
            continue
        kept.append(item)
        upstream.mark_guarded_item(item, key, EXPECTED_FAILURES)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
