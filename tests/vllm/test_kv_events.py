"""vLLM's KV events and eviction metrics in guarded mode: ``BlockStored`` only once the
filling step validated (the same hashes, tokens and chain as stock vLLM's, one event per
block), ``BlockRemoved`` and the collector's eviction notice on eviction."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402

from kvguard.adapters.vllm import GuardConfig, GuardedBlockPool  # noqa: E402

from .harness import BLOCK, make_request  # noqa: E402


def _pool(guarded: bool, collector: Any = None) -> Any:
    if guarded:
        return GuardedBlockPool(
            6, True, BLOCK, True, collector, guard=GuardConfig(check_invariants=True)
        )
    return BlockPool(6, True, BLOCK, True, collector)


def _fill(pool: Any, guarded: bool, prompt: list[int], req_id: str) -> tuple[Any, list[Any]]:
    """Allocate two blocks for a two-block prompt and cache them, as a step would."""
    request = make_request(req_id, prompt)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2, BLOCK, 0)
    return request, blocks


def _validate(pool: Any) -> None:
    pool.validate_fills([b for _, ids, _, _ in pool.take_cached() for b in ids])


def test_block_stored_waits_for_validation_and_matches_stock() -> None:
    prompt = list(range(2 * BLOCK))
    stock = _pool(False)
    _fill(stock, False, prompt, "r")
    (expected,) = stock.take_events()  # vLLM: one event for the blocks cached together

    guarded = _pool(True)
    _fill(guarded, True, prompt, "r")
    assert guarded.take_events() == []  # the step that fills them has not validated
    _validate(guarded)
    events = guarded.take_events()  # kvguard: one per block, as each is published
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    assert [h for e in events for h in e.block_hashes] == expected.block_hashes
    assert [t for e in events for t in e.token_ids] == expected.token_ids
    assert events[0].parent_block_hash == expected.parent_block_hash
    assert events[1].parent_block_hash == expected.block_hashes[0]
    assert {(e.block_size, e.medium, e.lora_name) for e in events} == {
        (expected.block_size, expected.medium, expected.lora_name)
    }
    guarded.check_consistency()


def test_eviction_emits_block_removed_and_reaches_the_metrics_collector() -> None:
    evicted: list[int] = []

    class Collector:
        def on_block_allocated(self, block: Any) -> None:
            pass

        def on_block_accessed(self, block: Any) -> None:
            pass

        def on_block_evicted(self, block: Any) -> None:
            evicted.append(block.block_id)

        def reset(self) -> None:
            pass

    pool = _pool(True, Collector())
    _, blocks = _fill(pool, True, list(range(2 * BLOCK)), "r")
    _validate(pool)
    pool.free_blocks(reversed(blocks))
    stored = pool.take_events()
    assert [type(e) for e in stored] == [BlockStored, BlockStored]
    pool.get_new_blocks(5)  # every free block: both cached ones are evicted
    removed = pool.take_events()
    assert [type(e) for e in removed] == [BlockRemoved, BlockRemoved]
    assert {h for e in removed for h in e.block_hashes} == {
        h for e in stored for h in e.block_hashes
    }
    assert sorted(evicted) == sorted(b.block_id for b in blocks)
    pool.check_consistency()
