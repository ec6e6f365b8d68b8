"""What a guarded vLLM scheduler's requests recompute when their steps in flight are
lost, by approach, read at the fault (before ``recover()``): kvguard's rollback, and
dropping the touched blocks and preempting (vLLM PR #50265) or aborting and
resubmitting. The rule is :func:`kvguard.recovery.recompute_after_lost_steps`, the one
the simulator applies (``kvguard simulate``'s rank faults); this reads its inputs from
vLLM. Used by the scheduler-level test (``tests/vllm/test_recover.py``) and the
real-engine one (``tests/e2e/test_recover.py``). Imports no vLLM.
"""

from __future__ import annotations

from typing import Any

from kvguard.recovery import RecomputeCost, recompute_after_lost_steps
from kvguard.states import MATCHABLE_STATES


def recompute_costs(scheduler: Any) -> dict[str, RecomputeCost]:
    """Per request with a step in flight (vLLM's request id): its computed tokens, the
    tokens its steps in flight compute (kvguard's ledger) and its leading published
    blocks (kvguard's pool), through the one rule. A single KV cache group."""
    core = scheduler.kvguard_pool.core
    ledger = scheduler._kvguard_ledger
    out = {}
    for req_id in ledger.requests_in_flight():
        (blocks,) = scheduler.kv_cache_manager.get_block_ids(req_id)
        published = 0
        for block_id in blocks:
            if core.block_state(block_id) not in MATCHABLE_STATES:
                break
            published += 1
        out[req_id] = recompute_after_lost_steps(
            scheduler.requests[req_id].num_computed_tokens,
            ledger.tokens_in_flight(req_id),
            scheduler.block_size,
            published,
        )
    return out
