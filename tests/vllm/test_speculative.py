"""Speculative decoding under the guard, on real vLLM 0.33 schedulers (sync: ngram
drafts fed back as the engine does; async: ngram_gpu, drafts proposed on the worker).

The guard accepts it when kvguard's plugin ran with ``KVGUARD_GUARD=1``: it makes vLLM's
workers count NaNs per request (``test_worker_nans.py``; here the ``per_request_nans``
fixture does what the plugin does). A step of a request with drafts writes KV at the
draft positions too; KV of rejected drafts belongs to another token prefix and must
never be published. Random fault traces with drafts are in ``test_fault_fuzz.py``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402

from kvguard import BlockState  # noqa: E402
from kvguard.adapters.vllm.pool.block_pool import GuardModeUnsupported  # noqa: E402

from .harness import (  # noqa: E402
    BLOCK,
    Arrivals,
    decision_trace,
    finish_reasons,
    hit_tokens,
    make_request,
    make_scheduler,
    model_output,
    ngram_speculation,
    shared_prefix_arrivals,
)

TOKEN = 5  # what the model samples every time: a draft is accepted iff it is TOKEN
SPEC_TOKENS = 3


def scheduler(*, guarded: bool = True, async_scheduling: bool = False, **kw: Any) -> Any:
    return make_scheduler(
        guarded=guarded,
        async_scheduling=async_scheduling,
        speculative_config=ngram_speculation(SPEC_TOKENS, async_scheduling=async_scheduling),
        **kw,
    )


class Drafts:
    """The worker's side: which drafts it proposes and how many the model accepts.
    Deterministic per seed, so a stock and a guarded scheduler see the same ones."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.accepted = self.rejected = 0

    def propose(self, s: Any) -> None:
        """Sync: the engine hands the scheduler the drafts after each output."""
        req_ids = sorted(
            r for r, q in s.requests.items() if not q.is_finished() and not q.is_prefill_chunk
        )
        drafts = [self._draft() for _ in req_ids]
        s.update_draft_token_ids(DraftTokenIds(req_ids, drafts))

    def _draft(self) -> list[int]:
        n = self.rng.randrange(SPEC_TOKENS + 1)
        return [TOKEN if self.rng.random() < 0.6 else 7 for _ in range(n)]

    def output(self, s: Any, so: Any, nans: Mapping[str, int] | None = None) -> ModelRunnerOutput:
        """The step's output: accepted drafts and a bonus token for each request whose
        step ends its prefill or decodes. Async drafts are placeholders (-1): the
        worker's own are drawn here."""
        out = model_output(s, so, nans, token=TOKEN)
        rows = out.sampled_token_ids
        for i, req_id in enumerate(out.req_ids):
            if not rows[i]:
                continue  # an intermediate prefill chunk samples nothing
            drafts = list(so.scheduled_spec_decode_tokens.get(req_id, ()))
            if drafts and drafts[0] == -1:
                drafts = self._draft()[: len(drafts)]
            n = 0
            while n < len(drafts) and drafts[n] == TOKEN:
                n += 1
            self.accepted += n
            self.rejected += len(drafts) - n
            rows[i] = [TOKEN] * (n + 1)
        return out


def spec_trace(
    s: Any,
    arrivals: Arrivals,
    steps: int,
    drafts: Drafts,
    *,
    async_scheduling: bool = False,
    nans: Callable[[int, Any], Mapping[str, int]] | None = None,
) -> list[object]:
    """``harness.decision_trace`` with drafts: the worker's outputs accept some, and
    (sync) the engine hands the scheduler new ones after each output."""
    return decision_trace(
        s,
        arrivals,
        steps,
        async_scheduling=async_scheduling,
        nans=nans,
        worker=drafts.output,
        after_output=None if async_scheduling else drafts.propose,
    )


def test_guard_takes_drafts_only_when_workers_count_per_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvguard.adapters.vllm.workers import nans as worker_nans

    monkeypatch.setattr(worker_nans.PATCHES, "applied", False)
    monkeypatch.delenv("KVGUARD_GUARD", raising=False)
    with pytest.raises(GuardModeUnsupported, match="KVGUARD_GUARD=1"):
        scheduler()
    # KVGUARD_GUARD=1 without the plugin having run (VLLM_PLUGINS leaving it out).
    monkeypatch.setenv("KVGUARD_GUARD", "1")
    with pytest.raises(GuardModeUnsupported, match="VLLM_PLUGINS"):
        scheduler()


def test_with_the_plugins_counting_the_guard_takes_drafts(per_request_nans: None) -> None:
    assert scheduler().num_spec_tokens == SPEC_TOKENS


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_clean_trace_with_drafts_schedules_as_stock_vllm(
    async_scheduling: bool, per_request_nans: None
) -> None:
    arrivals = shared_prefix_arrivals(seed=3, requests=14, max_suffix=40, output_tokens=(8, 40))
    traces, seen = [], []
    for guarded in (False, True):
        s = scheduler(guarded=guarded, async_scheduling=async_scheduling, num_blocks=48)
        drafts = Drafts(seed=11)
        traces.append(spec_trace(s, arrivals, 160, drafts, async_scheduling=async_scheduling))
        seen.append((drafts.accepted, drafts.rejected))
        assert not s.requests, "the trace did not drain"
        if guarded:
            s.kvguard_pool.check_consistency()
    assert traces[0] == traces[1]
    assert seen[0] == seen[1] and min(seen[0]) > 20  # drafts both accepted and rejected
    hits = [h for entry in traces[1] if isinstance(entry, tuple) for h in entry[2].values()]
    assert sum(1 for h in hits if h) >= 10  # the shared prefix was hit


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_nan_in_a_step_with_drafts_aborts_only_that_request(
    async_scheduling: bool, per_request_nans: None
) -> None:
    s = scheduler(async_scheduling=async_scheduling)
    prompt = list(range(300, 300 + 2 * BLOCK + 3))
    for rid in ("a", "b"):
        s.add_request(make_request(rid, [*prompt, ord(rid)], max_tokens=30))
    drafts = Drafts(seed=5)
    failed_at: list[int] = []

    def nans(t: int, so: Any) -> dict[str, int]:
        if so.scheduled_spec_decode_tokens.get("a") and not failed_at:
            failed_at.append(t)
            return {"a": 2}
        return {}

    trace = spec_trace(s, {}, 40, drafts, async_scheduling=async_scheduling, nans=nans)
    assert failed_at, "a never decoded with drafts"
    reasons = {r: v for entry in trace if isinstance(entry, dict) for r, v in entry.items()}
    assert reasons == {"a": "error", "b": "length"}
    assert s.kvguard_stats()["requests_aborted"] == 1
    # a's validated prompt blocks stay hits; what its failing step filled does not.
    s.add_request(make_request("c", [*prompt, ord("a")]))
    so = s.schedule()
    assert hit_tokens(so) == {"c": 2 * BLOCK}
    s.kvguard_pool.check_consistency()


def test_kv_of_rejected_drafts_is_not_published_until_rewritten(per_request_nans: None) -> None:
    """A 14-token prompt; the first decode step writes positions 14-17: the last known
    token and 3 drafts, all rejected, so position 15 of block 0 holds KV of a wrong
    token. Block 0 becomes a hit only after the next step rewrote position 15 and was
    counted clean -- and never if that step's logits are NaN."""
    for nan in (False, True):
        s = scheduler()
        prompt = list(range(500, 514))
        s.add_request(make_request("a", prompt, max_tokens=8))
        drafts = Drafts(seed=0)
        so = s.schedule()  # the prompt
        s.update_from_output(so, drafts.output(s, so))
        s.update_draft_token_ids(DraftTokenIds(["a"], [[7, 7, 7]]))
        so = s.schedule()
        assert so.num_scheduled_tokens == {"a": 4}
        s.update_from_output(so, drafts.output(s, so))
        assert drafts.rejected == 3 and s.requests["a"].num_computed_tokens == 15
        block0 = s.kv_cache_manager.get_block_ids("a")[0][0]
        assert s.kvguard_pool.core.block_state(block0) is BlockState.WRITTEN
        # Admitted now, b asks for the same 16 tokens: no hit on the stale slot.
        s.add_request(make_request("b", [*prompt, TOKEN, TOKEN, 1, 2]))
        so = s.schedule()  # rewrites position 15 (a's bonus token) and b's prompt
        assert hit_tokens(so) == {"b": 0}
        out = s.update_from_output(so, drafts.output(s, so, {"a": 1} if nan else None))
        state = s.kvguard_pool.core.block_state(block0)
        if nan:
            assert finish_reasons(out) == {"a": "error"}
            assert state is BlockState.QUARANTINED
        else:
            assert state in (BlockState.VALIDATED, BlockState.PUBLISHED)
            s.add_request(make_request("c", [*prompt, TOKEN, TOKEN, 3]))
            so = s.schedule()
            assert hit_tokens(so)["c"] == BLOCK
        s.kvguard_pool.check_consistency()
