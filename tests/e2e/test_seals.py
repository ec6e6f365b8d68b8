"""Seals (``{"kvguard": {"seal": true}}``) in a real engine: each block a step fills is
fingerprinted by the worker after the forward, and the pool records that seal with the
block when the step validates -- the seal of exactly the KV the validation vouched for.

In-process, the pool's seals are compared with seals taken afresh of the worker's own
KV cache tensors (``collective_rpc``); in vLLM's multiprocess engine the seals cross
from the worker process to the engine core with the step's NaN counts, counted by
``blocks_sealed``. Asynchronous scheduling, where the counts stay on the device, is
refused at start-up.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import HAVE_ENGINE, SKIP_REASON

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not HAVE_ENGINE, reason=SKIP_REASON)]

if HAVE_ENGINE:
    from .conftest import guard_in_this_process, in_process, kvguard_log, shutdown
    from .engine import (
        BLOCK,
        ENGINE_KWARGS,
        apply_env,
        engine_env,
        generate,
        matchable_blocks,
        restore_env,
        scheduler,
        tokens,
    )

SEAL = {"kvguard": {"seal": True}}


def worker_seals(worker: Any, block_ids: list[int]) -> dict[int, int]:
    """In the worker: the seals of ``block_ids`` taken afresh of its KV cache."""
    from kvguard.adapters.vllm.workers.seals import seal_step

    return seal_step(worker.model_runner, {"": block_ids})


@pytest.fixture(scope="module")
def sealed(model_dir: str) -> Iterator[tuple[Any, list[logging.LogRecord]]]:
    from vllm import LLM

    with guard_in_this_process():  # (left only once the engine is shut down)
        with in_process(), kvguard_log() as log:
            llm = LLM(model=model_dir, additional_config=SEAL, **ENGINE_KWARGS)
        try:
            yield llm, log
        finally:
            shutdown(llm)


def test_every_published_block_carries_the_seal_of_its_kv(
    sealed: tuple[Any, list[logging.LogRecord]], reference: Any
) -> None:
    """x (3 full blocks and 5 tokens) runs to its end: its three full blocks are
    published with the seal of the bytes the worker holds for them, equal to a seal
    taken afresh; the output is the fault-free one."""
    llm, log = sealed
    (start,) = [r for r in log if "guard in force" in r.getMessage()]
    assert "seals: on;" in start.getMessage()
    x = tokens(611, 3 * BLOCK + 5)
    (want,) = generate(reference, [x], max_tokens=4)
    before = scheduler(llm).kvguard_stats()["blocks_sealed"]
    (out,) = generate(llm, [x], max_tokens=4)
    assert out.token_ids == want.token_ids
    pool = scheduler(llm).kv_cache_manager.block_pool
    published = sorted(b for b in matchable_blocks(llm) if pool.core.block_seal(b) is not None)
    assert len(published) == 3
    (fresh,) = llm.collective_rpc(worker_seals, args=(published,))
    assert {b: pool.core.block_seal(b) for b in published} == fresh
    assert len(set(fresh.values())) == 3
    assert scheduler(llm).kvguard_stats()["blocks_sealed"] - before == 3
    # A copy of a sealed block carries its seal (what a tier keeps and checks on load).
    ticket = pool.core.begin_store(published[0], "test")
    assert ticket.seal == fresh[published[0]]
    pool.core.fail_store(ticket)


def test_seals_cross_from_the_worker_process_to_the_engine_core(model_dir: str) -> None:
    """vLLM's multiprocess engine: the worker seals, the engine core records."""
    from vllm import LLM

    env = engine_env(guard=True)
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", KVGUARD_SEAL="1")
    saved = apply_env(env)
    try:
        llm = LLM(model=model_dir, **ENGINE_KWARGS)
    finally:
        restore_env(saved)
    try:
        core = llm.llm_engine.engine_core
        assert type(core).__name__ == "SyncMPClient"
        before = core.call_utility("kvguard_stats")["blocks_sealed"]
        generate(llm, [tokens(612, 2 * BLOCK + 1)], max_tokens=2)
        assert core.call_utility("kvguard_stats")["blocks_sealed"] - before == 2
    finally:
        shutdown(llm)


def test_seals_under_async_scheduling_are_refused_at_start_up(model_dir: str) -> None:
    """Forced async scheduling (vLLM's CPU platform switches it off unless the test
    plugin puts it back): the engine does not start, and says why."""
    from kvguard_e2e_nan_model import ASYNC_ENV, allow_async_scheduling_on_cpu
    from vllm import LLM

    allow_async_scheduling_on_cpu()
    saved = apply_env({ASYNC_ENV: "1"})
    try:
        with guard_in_this_process(), in_process():  # noqa: SIM117
            with pytest.raises(Exception, match="synchronous scheduling"):
                LLM(
                    model=model_dir,
                    additional_config=SEAL,
                    async_scheduling=True,
                    **ENGINE_KWARGS,
                )
    finally:
        restore_env(saved)
