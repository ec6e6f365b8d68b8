"""A NaN in one request's logits aborts that request alone, on the real vLLM scheduler."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm.config import SpeculativeConfig  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from kvguard import BlockState  # noqa: E402
from kvguard.adapters.vllm.config import GuardConfigError  # noqa: E402
from kvguard.adapters.vllm.pool.block_pool import GuardModeUnsupported  # noqa: E402

from .harness import (  # noqa: E402
    BLOCK,
    finish_reasons,
    hit_tokens,
    make_request,
    make_scheduler,
    model_output,
    step,
)

PROMPT = list(range(1000, 1000 + 4 * BLOCK))  # 4 full blocks


def _states(scheduler: Any, req_id: str) -> list[BlockState]:
    core = scheduler.kvguard_pool.core
    (ids,) = scheduler.kv_cache_manager.get_block_ids(req_id)
    return [core.block_state(b) for b in ids]


@pytest.mark.parametrize("nan_chunk", [1, 3])  # an intermediate chunk, the final chunk
def test_nan_in_prefill_chunk_aborts_only_that_request(nan_chunk: int) -> None:
    s = make_scheduler(max_num_batched_tokens=BLOCK + 1)
    s.add_request(make_request("b", list(range(5000, 5008)), max_tokens=12))  # bystander
    step(s)  # b's prefill; from now on b decodes one token per step beside a's chunks
    s.add_request(make_request("a", PROMPT))
    reasons: dict[str, str] = {}
    for chunk in range(4):
        so = s.schedule()
        assert so.num_scheduled_tokens == {"b": 1, "a": BLOCK}
        nans = {"a": 3} if chunk == nan_chunk else {}
        out = s.update_from_output(so, model_output(s, so, nans))
        reasons.update(finish_reasons(out))
        s.kvguard_pool.check_consistency()
        if "a" in reasons:
            break
    assert reasons["a"] == "error"
    assert "a" not in s.requests
    # The validated chunks stay published; the failed one was quarantined.
    core = s.kvguard_pool.core
    stats = core.stats()
    assert stats.blocks_by_state[BlockState.QUARANTINED] == 1
    assert stats.blocks_by_state[BlockState.PUBLISHED] == nan_chunk
    assert s.kvguard_stats()["requests_aborted"] == 1
    # The bystander keeps decoding to its normal end.
    while "b" not in reasons:
        _, out = step(s)
        reasons.update(finish_reasons(out))
    assert reasons["b"] == "length"


def test_retry_after_abort_hits_exactly_the_validated_prefix() -> None:
    s = make_scheduler(max_num_batched_tokens=BLOCK)
    s.add_request(make_request("a", PROMPT))
    step(s)
    step(s)
    _, out = step(s, {"a": 1})  # third chunk fails
    assert finish_reasons(out) == {"a": "error"}
    s.add_request(make_request("a-retry", PROMPT))
    so = s.schedule()
    assert hit_tokens(so) == {"a-retry": 2 * BLOCK}
    # The quarantined block is reused first, and zeroed before the step runs.
    zeroed = so.new_block_ids_to_zero or []
    assert len(zeroed) == 1
    (table,) = s.kv_cache_manager.get_block_ids("a-retry")
    assert zeroed[0] in table and zeroed[0] not in table[:2]
    s.update_from_output(so, model_output(s, so))
    s.kvguard_pool.check_consistency()


def test_nan_in_decode_aborts_and_keeps_prompt_blocks() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", PROMPT[: 2 * BLOCK + 3], max_tokens=20))
    s.add_request(make_request("b", list(range(7000, 7040)), max_tokens=20))
    step(s)  # prefill both
    step(s)  # one decode step
    _, out = step(s, {"a": 7})
    assert finish_reasons(out) == {"a": "error"}
    assert "b" in s.requests and "a" not in s.requests
    core = s.kvguard_pool.core
    assert core.stats().blocks_by_state[BlockState.QUARANTINED] == 1  # the partial tail
    # a's two full prompt blocks stay hits for everybody.
    s.add_request(make_request("c", PROMPT[: 2 * BLOCK + 3]))
    so = s.schedule()
    assert hit_tokens(so)["c"] == 2 * BLOCK


def test_nan_tokens_are_never_delivered() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", PROMPT[:20]))
    so = s.schedule()
    out = s.update_from_output(so, model_output(s, so, {"a": 1}, token=999))
    (o,) = [o for eco in out.values() for o in eco.outputs if o.request_id == "a"]
    assert o.new_token_ids == [] and str(o.finish_reason) == "error"


def test_async_nan_quarantines_the_step_in_flight_behind_it() -> None:
    s = make_scheduler(async_scheduling=True, max_num_batched_tokens=BLOCK)
    s.add_request(make_request("a", PROMPT))
    so1 = s.schedule()
    so2 = s.schedule()  # step 2 scheduled before step 1's output arrived
    assert so2.num_scheduled_tokens == {"a": BLOCK}
    out = s.update_from_output(so1, model_output(s, so1, {"a": 2}))
    assert finish_reasons(out) == {"a": "error"}
    s.update_from_output(so2, model_output(s, so2))  # late output of the aborted request
    core = s.kvguard_pool.core
    assert core.stats().blocks_by_state[BlockState.QUARANTINED] == 2
    assert core.stats().blocks_by_state[BlockState.PUBLISHED] == 0
    s.kvguard_pool.check_consistency()


def test_guard_refuses_to_start_without_nan_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_COMPUTE_NANS_IN_LOGITS", "0")
    with pytest.raises(GuardConfigError, match="VLLM_COMPUTE_NANS_IN_LOGITS=1"):
        make_scheduler()
    # Pass-through needs no NaN counts.
    make_scheduler(kvguard={"enabled": False})


def test_guard_refuses_speculative_decoding_without_per_request_counts() -> None:
    # vLLM 0.33 maps per-row NaN counts to requests by row index: with draft tokens they
    # would validate the wrong requests' steps, unless kvguard's plugin made the workers
    # count per request (test_speculative.py). (The check is in the mixin both guarded
    # schedulers share; vLLM itself refuses ngram drafts with async scheduling on CPU.)
    def speculative() -> SpeculativeConfig:
        return SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3)

    with pytest.raises(GuardModeUnsupported, match="speculative decoding"):
        make_scheduler(speculative_config=speculative())
    # Pass-through runs vLLM's own speculative decoding as before.
    s = make_scheduler(speculative_config=speculative(), kvguard={"enabled": False})
    assert s.num_spec_tokens == 2 and type(s) is Scheduler


def _without_count(scheduler: Any, scheduler_output: Any, req_id: str) -> Any:
    """The worker's output with ``req_id`` left out of the NaN counts."""
    output = model_output(scheduler, scheduler_output)
    del output.num_nans_in_logits[req_id]
    return output


def test_a_step_without_a_nan_count_waits_for_a_counted_step() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", PROMPT, max_tokens=8))
    so = s.schedule()
    s.update_from_output(so, _without_count(s, so, "a"))  # a's prefill: not counted
    assert _states(s, "a") == [BlockState.WRITTEN] * 4
    assert s.kvguard_stats()["steps_unchecked"] == 1
    # Not shared while unchecked: b, admitted now, gets no hit.
    s.add_request(make_request("b", PROMPT, max_tokens=8))
    so = s.schedule()
    assert hit_tokens(so) == {"b": 0}
    s.update_from_output(so, model_output(s, so))  # a's decode step, counted clean
    s.kvguard_pool.check_consistency()
    # a's next counted step vouched for its prompt: validated now (b's copies, filled in
    # the same step, may have been indexed first), and a hit for c.
    assert set(_states(s, "a")[:4]) <= {BlockState.VALIDATED, BlockState.PUBLISHED}
    s.add_request(make_request("c", PROMPT))
    so = s.schedule()
    assert hit_tokens(so)["c"] == 3 * BLOCK


def test_a_request_leaving_after_an_unchecked_step_is_quarantined() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", PROMPT, max_tokens=1))
    so = s.schedule()
    out = s.update_from_output(so, _without_count(s, so, "a"))
    assert finish_reasons(out) == {"a": "length"}  # vLLM's own stop: delivered as usual
    stats = s.kvguard_pool.core.stats()
    assert stats.blocks_by_state[BlockState.QUARANTINED] == 4
    assert stats.blocks_by_state[BlockState.PUBLISHED] == 0
    s.kvguard_pool.check_consistency()
