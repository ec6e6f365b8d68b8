"""Pooling models (embedding, reranking) run unguarded: their steps sample nothing and
vLLM reports no NaN counts for them, so no step could ever validate. The guarded
scheduler runs them in pass-through mode (vLLM's own pool and code paths) and says so
in one log line, instead of refusing their first output."""

from __future__ import annotations

import logging

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.pooling_params import PoolingParams  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvguard.adapters.vllm._compat import runner_output_rows  # noqa: E402

from .harness import _HASHER, BLOCK, finish_reasons, make_scheduler  # noqa: E402


def _embed_request(request_id: str, prompt: list[int]) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=None,
        pooling_params=PoolingParams(task="embed"),
        block_hasher=_HASHER,
    )


def _pooler_output(so: object, done: set[str]) -> ModelRunnerOutput:
    """What a pooling runner returns: an embedding for each request whose prompt is
    complete, no sampled tokens, and no NaN counts."""
    req_ids = list(so.num_scheduled_tokens)  # type: ignore[attr-defined]
    return ModelRunnerOutput(
        **runner_output_rows(req_ids),
        sampled_token_ids=[[] for _ in req_ids],
        pooler_output=[torch.ones(4) if r in done else None for r in req_ids],
        num_nans_in_logits=None,
    )


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_pooling_model_runs_in_pass_through_with_one_log_line(
    async_scheduling: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    s = make_scheduler(runner="pooling", async_scheduling=async_scheduling)
    prompts = {"e1": list(range(100, 100 + 2 * BLOCK + 3)), "e2": list(range(400, 420))}
    for rid, prompt in prompts.items():
        s.add_request(_embed_request(rid, prompt))
    reasons: dict[str, str] = {}
    for _ in range(10):
        so = s.schedule()
        # vLLM counts scheduled tokens as computed at schedule time: a request whose
        # prompt is all scheduled gets its embedding from this step.
        done = {
            r
            for r in so.num_scheduled_tokens
            if s.requests[r].num_computed_tokens >= len(prompts[r])
        }
        reasons.update(finish_reasons(s.update_from_output(so, _pooler_output(so, done))))
        if not s.requests:
            break
    assert reasons == {"e1": "stop", "e2": "stop"}
    # Pass-through: vLLM's own scheduler and pool.
    assert type(s) is (AsyncScheduler if async_scheduling else Scheduler)
    assert type(s.kv_cache_manager.block_pool) is BlockPool
    lines = [r.getMessage() for r in caplog.records if "pooling" in r.getMessage()]
    assert len(lines) == 1 and "pass-through" in lines[0], lines
