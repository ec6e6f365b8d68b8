"""Pass-through mode (``KVGUARD_GUARD=0``): vLLM's own code, reached directly.

A guard switched off must cost nothing beyond being another class: the pool and the
scheduler bind vLLM's own methods on the instance, so vLLM's calls skip kvguard's
overrides (each would add a frame to reach ``super()``), and decisions, NaN handling
included, are stock vLLM's.
"""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from kvguard.adapters.vllm import GuardedBlockPool  # noqa: E402
from kvguard.adapters.vllm.config import GuardConfig  # noqa: E402

from .harness import (  # noqa: E402
    BLOCK,
    decision_trace,
    make_scheduler,
)

# Spelled out, not read from the adapter: a method that gains an override must be
# added here, and one that loses its fast path fails.
POOL_METHODS = (
    "get_cached_block",
    "cache_full_blocks",
    "get_new_blocks",
    "touch",
    "free_blocks",
    "evict_blocks",
    "reset_prefix_cache",
    "cache_partial_block",
    "move_block_hashes",
    "unpin_blocks",
)
SCHEDULER_HOOKS = (
    "schedule",
    "update_from_output",
    "_get_new_block_ids_to_zero",
    "_free_request",
    "_free_request_blocks",
    "make_stats",
)


def test_every_override_of_vllms_pool_is_listed() -> None:
    overridden = {
        name
        for name, value in vars(GuardedBlockPool).items()
        if callable(value) and not name.startswith("__") and hasattr(BlockPool, name)
    }
    assert overridden == set(POOL_METHODS)


def test_pass_through_pool_calls_vllms_own_methods() -> None:
    off = GuardedBlockPool(16, True, BLOCK, guard=GuardConfig(enabled=False))
    on = GuardedBlockPool(16, True, BLOCK, guard=GuardConfig(enabled=True))
    for name in POOL_METHODS:
        assert getattr(off, name).__func__ is getattr(BlockPool, name), name
        assert getattr(on, name).__func__ is getattr(GuardedBlockPool, name), name


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pass_through_scheduler_runs_vllms_own_hooks(async_scheduling: bool) -> None:
    vllm_cls = AsyncScheduler if async_scheduling else Scheduler
    off = make_scheduler(async_scheduling=async_scheduling, kvguard={"enabled": False})
    on = make_scheduler(async_scheduling=async_scheduling)
    for name in SCHEDULER_HOOKS:
        assert getattr(off, name).__func__ is getattr(vllm_cls, name), name
        assert getattr(on, name).__func__ is getattr(type(on), name), name
        assert getattr(type(on), name) is not getattr(vllm_cls, name), name


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pass_through_decides_as_stock_vllm_with_nans(async_scheduling: bool) -> None:
    """Shared prefixes, preemption (few blocks) and NaN counts: pass-through ignores
    the counts and decides exactly as stock vLLM; the guard, on, does not."""
    rng = random.Random(5)
    shared = list(range(7000, 7000 + 2 * BLOCK))
    arrivals = {}
    for i in range(16):
        suffix = [rng.randrange(50_000) for _ in range(rng.randrange(1, 3 * BLOCK))]
        arrivals[i] = (f"r{i}", shared + suffix, rng.randrange(2, 12))
    runs: list[list[object]] = []
    for kind in ("stock", "pass-through", "guarded"):
        s = make_scheduler(
            guarded=kind != "stock",
            async_scheduling=async_scheduling,
            num_blocks=12,
            kvguard={"enabled": kind == "guarded"},
        )
        trace = decision_trace(
            s,
            arrivals,
            60,
            async_scheduling=async_scheduling,
            nans=lambda t, done: {"r2": 1} if t >= 3 and "r2" in done.num_scheduled_tokens else {},
        )
        runs.append(trace)
    stock, pass_through, guarded = runs
    assert pass_through == stock
    assert guarded != stock  # the NaN counts mattered: the guard aborted r2
    assert any(p for entry in stock if isinstance(entry, tuple) for p in entry[3])
