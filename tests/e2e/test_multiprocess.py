"""The guard in vLLM's default multiprocess engine: the engine core and its worker run
in processes of their own (spawned), which load vLLM's plugins themselves -- kvguard's
(switched on by ``KVGUARD_GUARD=1`` in their environment) and the test model's. Stock
and guarded engines side by side, as a client sees them; the worker's KV tensors are
read through ``collective_rpc``.
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
        ENGINE_KWARGS,
        Result,
        apply_env,
        engine_env,
        faults_fired,
        generate,
        model_name,
        non_finite_blocks,
        restore_env,
        tokens,
        trigger,
        with_token,
    )


def _engine(model_dir: str, guard: bool) -> Any:
    from vllm import LLM

    env = engine_env(guard)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    saved = apply_env(env)
    try:
        llm = LLM(model=model_dir, **ENGINE_KWARGS)
    finally:
        restore_env(saved)
    assert type(llm.llm_engine.engine_core).__name__ == "SyncMPClient"
    return llm


@pytest.fixture(scope="module")
def engines(model_dir: str, reference: Any) -> Iterator[dict[str, Any]]:
    built = {"stock": _engine(model_dir, guard=False)}
    try:
        built["guarded"] = _engine(model_dir, guard=True)
        yield built
    finally:
        for llm in built.values():
            shutdown(llm)


def test_the_engine_processes_run_the_test_model(engines: dict[str, Any]) -> None:
    for llm in engines.values():
        assert llm.apply_model(model_name) == ["NanLlamaForCausalLM"]


def test_nan_in_prefill_chunk_2_and_same_prefix_requests(
    reference: Any, engines: dict[str, Any]
) -> None:
    """As in-process: A's chunk 2 computes NaN; B (with A) and C (after A) share A's
    first 128 tokens. Stock delivers NaN-derived tokens for all three; guarded ends A
    with "error" and no token, and B and C get the fault-free output."""
    a = with_token(tokens(101, 158), 90, trigger(0))
    b = a[:128] + tokens(102, 30)
    c = a[:128] + tokens(103, 30)
    ref_a, ref_b, ref_c = generate(reference, [a, b, c])
    out = {}
    for name, llm in engines.items():
        a_out, b_out = generate(llm, [a, b])
        (c_out,) = generate(llm, [c])
        assert (90, trigger(0)) in faults_fired(llm), name
        out[name] = (a_out, b_out, c_out)

    a_out, b_out, c_out = out["stock"]
    assert a_out.finish_reason == "length" and a_out.token_ids != ref_a.token_ids
    assert b_out.num_cached_tokens == 128 and b_out.token_ids != ref_b.token_ids
    assert c_out.num_cached_tokens == 128 and c_out.token_ids != ref_c.token_ids

    a_out, b_out, c_out = out["guarded"]
    assert (a_out.token_ids, a_out.finish_reason) == ((), "error")
    assert b_out == Result(ref_b.token_ids, "length", 64)
    assert c_out == Result(ref_c.token_ids, "length", 128)


def test_retry_hits_exactly_the_validated_prefix(reference: Any, engines: dict[str, Any]) -> None:
    a = with_token(tokens(110, 150), 100, trigger(0))
    (ref,) = generate(reference, [a])
    retries = {}
    for name, llm in engines.items():
        (first,) = generate(llm, [a])
        assert first.token_ids != ref.token_ids, name
        (retries[name],) = generate(llm, [a])
    assert retries["stock"].num_cached_tokens == 128
    assert retries["stock"].token_ids != ref.token_ids
    assert retries["guarded"] == Result(ref.token_ids, "length", 64)


def test_no_nan_survives_in_the_kv_cache_once_reused(
    reference: Any, engines: dict[str, Any]
) -> None:
    """A fails in chunk 2 (two blocks of NaN KV in the worker's tensors). R then needs
    four new blocks. Guarded: kvguard reuses the quarantined blocks first and has the
    worker zero them, so afterwards no block of the whole KV cache holds a non-finite
    value. Stock: A's NaN blocks stay in its prefix cache, untouched."""
    a = with_token(tokens(120, 126), 70, trigger(0))
    r = tokens(121, 120)
    (ref_r,) = generate(reference, [r], max_tokens=4)
    for name, llm in engines.items():
        before = non_finite_blocks(llm)
        (a_out,) = generate(llm, [a], max_tokens=1)
        poisoned = non_finite_blocks(llm) - before
        assert len(poisoned) == 2, (name, poisoned)  # A's chunk-2 blocks, in the tensors
        (r_out,) = generate(llm, [r], max_tokens=4)
        assert r_out.token_ids == ref_r.token_ids, name
        left = non_finite_blocks(llm)
        if name == "stock":
            assert a_out.finish_reason == "length"
            assert poisoned & left  # its cached chunk-2 block
        else:
            assert a_out.finish_reason == "error"
            assert not left, left
