"""Seeded random stress: an engine-like loop over thousands of steps.

Requests share a few system prompts, prefill in chunks, decode, keep up to two steps in
flight (async scheduling), fail at random, get preempted when blocks run out, and are
sometimes rolled back with ``zero_request_tail`` instead of aborted. After every step
the pool's invariants are checked, plus the safety property that every prefix hit is
made of blocks whose writes all validated (tracked independently of the pool).
"""

from __future__ import annotations

import random

import pytest

from kvguard import BlockPool, BlockState, OutOfBlocksError, StepOutcome

BLOCK = 8
SYSTEM_PROMPTS = [[1000 * p + i for i in range(40)] for p in range(4)]


def run(seed: int, steps: int, *, fail_rate: float = 0.05) -> BlockPool:
    rng = random.Random(seed)
    pool = BlockPool(96, BLOCK)
    tainted: set[int] = set()  # blocks written by a step that has not validated
    inflight: dict[str, list[tuple[int, int]]] = {}  # rid -> (end, step) in flight
    prompts: dict[str, list[int]] = {}
    next_id = 0
    for step in range(steps):
        # Arrivals.
        if len(pool.request_ids) < 12 and rng.random() < 0.5:
            rid = f"r{next_id}"
            next_id += 1
            prompt = rng.choice(SYSTEM_PROMPTS) + [
                rng.randrange(50) for _ in range(rng.randrange(1, 30))
            ]
            prompts[rid] = prompt
            pool.add_request(rid, prompt)
            hit = pool.lookup(rid, max_tokens=len(prompt) - 1)
            for block_id in hit.block_ids:
                assert block_id not in tainted, f"step {step}: hit on unvalidated block"
                assert pool.block_info(block_id).state in (
                    BlockState.PUBLISHED,
                    BlockState.OFFLOADED,
                )
            try:
                pool.allocate(rid, hit.num_tokens + 1, hit=hit)
            except OutOfBlocksError:
                pool.free(rid)
                continue
            inflight[rid] = []
        # Schedule one step per live request (chunked prefill, then decode).
        for rid in list(pool.request_ids):
            progress = pool.progress(rid)
            if progress.aborted or len(inflight[rid]) >= 2:
                continue
            remaining = len(prompts[rid]) - progress.num_written_tokens
            n = min(remaining, rng.randrange(4, 24)) if remaining > 0 else 1
            try:
                pool.allocate(rid, progress.num_written_tokens + n)
            except OutOfBlocksError:
                pool.free(rid)  # preemption: in-flight writes become quarantined
                for block_id in pool.take_blocks_to_zero():
                    tainted.discard(block_id)
                del inflight[rid]
                continue
            for block_id in pool.take_blocks_to_zero():
                tainted.discard(block_id)  # zeroed bytes are clean
            tokens = pool.write(rid, n)
            table = pool.block_table(rid)
            for i in range(tokens.start // BLOCK, (tokens.end - 1) // BLOCK + 1):
                tainted.add(table[i])
            inflight[rid].append((tokens.end, step))
        # Results arrive one step late (async): validate or fail the oldest step.
        for rid in list(pool.request_ids):
            pending = inflight[rid]
            if not pending or pending[0][1] == step:
                continue
            pending.pop(0)
            if rng.random() < fail_rate:
                result = pool.fail_step(rid)
                if result.outcome is StepOutcome.FAILED and rng.random() < 0.5:
                    pool.zero_request_tail(rid)  # resume instead of abort
                    pool.take_slots_to_zero()
                    inflight[rid] = []
                continue
            result = pool.validate_step(rid)
            if result.outcome is not StepOutcome.VALIDATED:
                continue
            table = pool.block_table(rid)
            validated = result.num_validated_tokens
            written = pool.progress(rid).num_written_tokens
            for i, block_id in enumerate(table):
                if min((i + 1) * BLOCK, written) <= validated:
                    tainted.discard(block_id)
            if validated >= len(prompts[rid]):
                pool.append_tokens(rid, [rng.randrange(50)])
            if validated > len(prompts[rid]) + rng.randrange(5, 40):
                pool.free(rid)
                del inflight[rid]
        # Aborted requests are freed by the engine.
        for rid in list(pool.request_ids):
            progress = pool.progress(rid)
            if progress.aborted and not inflight[rid]:
                pool.free(rid)
                del inflight[rid]
            elif progress.aborted:
                inflight[rid].pop(0)
                pool.validate_step(rid)  # the discarded result of a step in flight
        pool.check_invariants()
        for _, block_id in pool.snapshot().index:
            assert block_id not in tainted, f"step {step}: published unvalidated block"
    return pool


@pytest.mark.parametrize("seed", range(4))
def test_seeded_stress(seed: int) -> None:
    pool = run(seed, 400)
    counters = pool.stats().counters
    # The run must exercise what it claims to.
    assert counters.blocks_published > 0
    assert counters.steps_failed > 0
    assert counters.lookup_hit_tokens > 0
    assert counters.blocks_quarantined > 0
