"""Pass-through mode (``KVGUARD_GUARD=0``): vLLM's own classes, not a mode of kvguard's.

A guard switched off must cost nothing and decide as vLLM does: building a guarded
scheduler with the guard off builds vLLM's own ``Scheduler`` / ``AsyncScheduler`` on
vLLM's own ``BlockPool`` (a factory, not ``if core is None`` branches), and decisions,
NaN handling included, are stock vLLM's.
"""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from kvguard.adapters.vllm import GuardedBlockPool, build_kv_cache_manager  # noqa: E402
from kvguard.adapters.vllm.config import GuardConfig, GuardConfigError  # noqa: E402
from kvguard.adapters.vllm.pool.manager import install_guarded_pool  # noqa: E402
from kvguard.adapters.vllm.scheduler.guarded import GuardedAsyncScheduler, GuardedScheduler  # noqa: E402

from .harness import (  # noqa: E402
    BLOCK,
    decision_trace,
    make_scheduler,
)

OFF = GuardConfig(enabled=False)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_guard_off_builds_vllms_own_scheduler_and_pool(async_scheduling: bool) -> None:
    vllm_cls = AsyncScheduler if async_scheduling else Scheduler
    guarded_cls = GuardedAsyncScheduler if async_scheduling else GuardedScheduler
    off = make_scheduler(async_scheduling=async_scheduling, kvguard={"enabled": False})
    assert type(off) is vllm_cls
    assert type(off.kv_cache_manager.block_pool) is BlockPool
    assert not hasattr(off, "kvguard_pool")
    on = make_scheduler(async_scheduling=async_scheduling)
    assert type(on) is guarded_cls
    assert type(on.kv_cache_manager.block_pool) is GuardedBlockPool


def test_the_guarded_pool_is_never_built_with_the_guard_off() -> None:
    with pytest.raises(GuardConfigError, match="always guarded"):
        GuardedBlockPool(16, True, BLOCK, guard=OFF)
    manager = build_kv_cache_manager(
        guard=OFF,
        kv_cache_config=make_scheduler(guarded=False).kv_cache_config,
        max_model_len=1024,
        scheduler_block_size=BLOCK,
        hash_block_size=BLOCK,
    )
    assert type(manager.block_pool) is BlockPool
    with pytest.raises(GuardConfigError, match="pass-through keeps vLLM's own pool"):
        install_guarded_pool(manager, OFF)
    assert type(manager.block_pool) is BlockPool


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
