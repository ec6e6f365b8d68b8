"""A worker fails mid-step after writing corrupt KV: vLLM's engine fault tolerance
aborts every request on stock vLLM; on the guarded engine the requests roll back to
their validated KV and finish with exactly their fault-free output.

In-process engines (the engine core in this process), stepped by the test. The fault is
the test model's ``arm_crash``: the step computing an armed position writes finite
garbage into that row's KV and raises. vLLM's fault tolerance cannot be started here
(``--enable-fault-tolerance`` needs the multiprocess engine's sentinel process and its
client), so the test drives vLLM's own ``EngineCoreSentinel.on_fault`` on the engine
core, as vLLM's fault-tolerance tests do, and then steps on (what ``retry`` resumes).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import HAVE_ENGINE, SKIP_REASON

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not HAVE_ENGINE, reason=SKIP_REASON)]

if HAVE_ENGINE:
    from kvguard_e2e_nan_model.model import InjectedFault

    from .conftest import guard_in_this_process, in_process, shutdown
    from .engine import (
        BLOCK,
        ENGINE_KWARGS,
        arm_crash,
        crashes_fired,
        generate,
        non_finite_blocks,
        result,
        tokens,
    )


@pytest.fixture(scope="module")
def engines(model_dir: str, reference: Any) -> Iterator[dict[str, Any]]:
    from vllm import LLM

    built: dict[str, Any] = {}
    with in_process():
        built["stock"] = LLM(model=model_dir, **ENGINE_KWARGS)
    with guard_in_this_process():
        with in_process():
            built["guarded"] = LLM(model=model_dir, **ENGINE_KWARGS)
        yield built
        for llm in built.values():
            shutdown(llm)


def _sentinel(llm: Any) -> tuple[Any, list[Any]]:
    """vLLM's fault sentinel over the in-process engine core (its scheduler and batch
    queue), and the list its aborts go to."""
    from tests.vllm.fault_sentinel import sentinel_over

    core = llm.llm_engine.engine_core.engine_core
    sentinel, engine = sentinel_over(core.scheduler, getattr(core, "batch_queue", None))
    return sentinel, engine.aborted


def _recompute_elsewhere(llm: Any) -> dict[str, int]:
    """At the fault, before recovery: the tokens the other approaches recompute. PR
    #50265 (vLLM) drops the blocks the lost step touched and preempts, and abort and
    resubmit starts the request over: either way a request keeps only its published
    full blocks below the lost step's first block (its prefix hits), and recomputes every
    other token it had computed (kvguard.recovery.recompute_after_lost_steps, the rule
    ``kvguard simulate`` applies too; kvguard keeps everything below the boundary)."""
    from tests.vllm.recompute import recompute_costs

    sched = llm.llm_engine.engine_core.engine_core.scheduler
    return {
        req_id.rsplit("-", 1)[0]: cost.drop_blocks
        for req_id, cost in recompute_costs(sched).items()
    }


def _run(
    llm: Any, prompts: dict[str, list[int]], max_tokens: int, at_fault: list[Any] | None = None
) -> tuple[dict[str, Any], Any]:
    """Submit ``prompts`` and step the engine until they finish or a step fails; on
    the failure, vLLM's ``on_fault``, then step on. Returns each request's final output
    and what the fault handler aborted (None: no fault); ``at_fault`` gets what the
    other approaches would recompute (guarded engines only)."""
    from vllm import SamplingParams, TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, TokensPrompt(prompt_token_ids=prompt), params)
    final: dict[str, Any] = {}
    aborted = None
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        try:
            outs = engine.step()
        except InjectedFault as exc:
            assert aborted is None, "one fault per run"
            if at_fault is not None:
                at_fault.append(_recompute_elsewhere(llm))
            sentinel, aborted = _sentinel(llm)
            sentinel.on_fault(exc)
            if aborted:  # the clients are told (what _send_abort_outputs does)
                engine.abort_request([r.request_id for r in aborted], internal=True)
            continue
        for out in outs:
            if out.finished:
                final[out.request_id] = result(out)
    return final, aborted


def test_a_crashed_step_resumes_from_validated_kv(reference: Any, engines: dict[str, Any]) -> None:
    """b (40-token prompt) decodes while a (150 tokens) prefills; the step computing
    a's tokens 24..86 and b's token 40 writes garbage KV at a's position 80 and fails.
    Stock: both requests aborted. Guarded: a resumes from token 24, b from token 40
    (its partial block keeps its validated 8 tokens), and both finish with exactly the
    fault-free output; no KV of theirs is non-finite, and a's full prompt serves a
    prefix hit to a later request. It recomputes 64 tokens where dropping the touched
    blocks and preempting, or aborting and resubmitting, recomputes 96."""
    a, b = tokens(401, 150), tokens(402, 40)
    ref_b, ref_a = generate(reference, [b, a], max_tokens=6)
    elsewhere: list[dict[str, int]] = []
    for name, llm in engines.items():
        arm_crash(llm, [80])
        at_fault = elsewhere if name == "guarded" else None
        final, aborted = _run(llm, {"b": b, "a": a}, max_tokens=6, at_fault=at_fault)
        assert crashes_fired(llm)[-1] == 80, name
        if name == "stock":
            # (vLLM's engine ids: the client's id and a suffix of its own)
            assert sorted(r.request_id.rsplit("-", 1)[0] for r in aborted) == ["a", "b"]
            assert not final
            continue
        assert aborted == []
        assert final["a"].token_ids == ref_a.token_ids
        assert final["b"].token_ids == ref_b.token_ids
        assert final["a"].finish_reason == final["b"].finish_reason == "length"
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        stats = sched.kvguard_stats()
        assert stats["requests_recovered"] == 2
        assert stats["tokens_rolled_back"] == 63 + 1
        # Recomputed tokens on this trace: kvguard 64 (a from 24, b from 40 inside its
        # partial block); dropping the touched blocks and preempting (vLLM PR #50265),
        # or aborting and resubmitting, keeps only b's published first block: 87 + 9.
        assert elsewhere == [{"a": 87, "b": 9}]
        assert not non_finite_blocks(llm)
        (again,) = generate(llm, [a[:140] + tokens(403, 10)], max_tokens=2)
        assert again.num_cached_tokens == 4 * BLOCK  # a's validated full blocks
