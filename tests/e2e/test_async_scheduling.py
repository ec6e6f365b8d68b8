"""Async scheduling (vLLM's ``AsyncScheduler``: step N+1 is scheduled before step N's
output is known), stock and guarded, in-process.

vLLM's CPU platform switches async scheduling off whatever was asked for
(``vllm/platforms/cpu.py``, ``check_and_update_config``: "async scheduling is not
required on CPU"). The test-only plugin distribution puts ``async_scheduling=True``
back while ``KVGUARD_E2E_ASYNC_SCHEDULING=1`` is set (``allow_async_scheduling_on_cpu``,
for the engines built here only), and vLLM's CPU
runner then runs with the engine core's batch queue: one step in flight while the
next is scheduled. This is the race kvguard's design is about: under async
scheduling a request admitted one step after the request writing a shared prefix
is scheduled while that step's output is unknown.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import HAVE_ENGINE, SKIP_REASON

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not HAVE_ENGINE, reason=SKIP_REASON)]

if HAVE_ENGINE:
    from kvguard_e2e_nan_model import ASYNC_ENV, allow_async_scheduling_on_cpu

    from .conftest import guard_in_this_process, in_process, shutdown
    from .engine import (
        BLOCK,
        ENGINE_KWARGS,
        Result,
        apply_env,
        generate,
        restore_env,
        scheduler,
        tokens,
        trigger,
        with_token,
    )


def _async_engine(model_dir: str) -> Any:
    from vllm import LLM

    allow_async_scheduling_on_cpu()  # (the plugin did, if it loaded in this process)
    saved = apply_env({ASYNC_ENV: "1"})
    try:
        with in_process():
            llm = LLM(model=model_dir, async_scheduling=True, **ENGINE_KWARGS)
    finally:
        restore_env(saved)
    core = llm.llm_engine.engine_core.engine_core
    assert core.vllm_config.scheduler_config.async_scheduling
    assert core.batch_queue is not None and core.batch_queue_size == 2  # a step in flight
    return llm


@pytest.fixture(scope="module")
def stock(model_dir: str, reference: Any) -> Iterator[Any]:
    llm = _async_engine(model_dir)
    assert type(scheduler(llm)).__name__ == "AsyncScheduler"
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def guarded(model_dir: str, stock: Any) -> Iterator[Any]:
    with guard_in_this_process():
        llm = _async_engine(model_dir)
        assert type(scheduler(llm)).__name__ == "GuardedAsyncScheduler"
        yield llm
        shutdown(llm)


def test_nan_in_prefill_chunk_2_with_a_step_in_flight(
    reference: Any, stock: Any, guarded: Any
) -> None:
    """A's chunk 2 computes NaN; B, submitted with A, shares A's first 128 tokens and
    is admitted while A's chunk-2 step is in flight. Stock: B hits A's chunk-2 blocks
    (cached when that step was scheduled) and delivers garbage, as does A. Guarded:
    A ends with "error" and no token; B hits A's first chunk only (validated by the
    time B is admitted) and gets the fault-free output; a retry of A too."""
    a = with_token(tokens(401, 158), 84, trigger(0))
    b = a[:128] + tokens(402, 30)
    ref_a, ref_b = generate(reference, [a, b])
    stock_a, stock_b = generate(stock, [a, b])
    assert stock_a.finish_reason == "length" and stock_a.token_ids != ref_a.token_ids
    assert stock_b.num_cached_tokens == 128 and stock_b.token_ids != ref_b.token_ids

    guarded_a, guarded_b = generate(guarded, [a, b])
    assert (guarded_a.token_ids, guarded_a.finish_reason) == ((), "error")
    assert guarded_b == Result(ref_b.token_ids, "length", 64)
    (retry,) = generate(guarded, [a])
    assert retry == Result(ref_a.token_ids, "length", 128)  # B's validated blocks


def test_nan_in_decode_with_a_step_in_flight(reference: Any, stock: Any, guarded: Any) -> None:
    """The fault fires in the decode step computing position 43 (output token 4).
    Under async scheduling the next step is already scheduled when its output comes
    back: guarded still delivers exactly the four clean tokens, then "error"."""
    d = with_token(tokens(410, 40), 3, trigger(40))  # 3 + 40 = 43
    (ref,) = generate(reference, [d])
    (stock_out,) = generate(stock, [d])
    assert stock_out.token_ids[:4] == ref.token_ids[:4]
    assert stock_out.token_ids[4:] != ref.token_ids[4:]
    (guarded_out,) = generate(guarded, [d])
    assert guarded_out.token_ids == ref.token_ids[:4]
    assert guarded_out.finish_reason == "error"
    (retry,) = generate(guarded, [d])
    assert retry == Result(ref.token_ids, "length", BLOCK)
