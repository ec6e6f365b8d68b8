"""``GuardedScheduler.recover()``: requests whose steps in flight are lost (a fault)
resume from their validated KV instead of being aborted.

Scheduler level, vLLM's real schedulers: a step is scheduled and its output never
processed (the fault), ``recover()`` rolls its requests back, and the requests run to
the end with the same outputs as without the fault. Checked: the boundary (the tokens
clean steps computed), the slots the workers are told to wipe (a partial block keeps its
validated prefix), what vLLM had cached of the lost step (published only after the
step recomputing it validates), and the requests that cannot resume.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from kvguard import BlockState  # noqa: E402
from kvguard.adapters.vllm.scheduler import guarded as scheduler_module  # noqa: E402
from kvguard.adapters.vllm.scheduler.recovery import ResumedRequest  # noqa: E402
from kvguard.errors import PoolMisuseError, UnknownRequestError  # noqa: E402
from kvguard.results import SlotRange  # noqa: E402

from .harness import (  # noqa: E402
    BLOCK,
    finish_reasons,
    hit_tokens,
    make_request,
    make_scheduler,
    model_output,
    step,
)

PROMPT = list(range(1000, 1150))  # 150 tokens: 9 full blocks and 6 tokens


def _blocks(s: Any, req_id: str) -> list[int]:
    (ids,) = s.kv_cache_manager.get_block_ids(req_id)
    return list(ids)


def _run_to_end(s: Any, limit: int = 50) -> dict[str, str]:
    reasons: dict[str, str] = {}
    for _ in range(limit):
        if not s.requests:
            return reasons
        _, out = step(s)
        reasons.update(finish_reasons(out))
    raise AssertionError("requests did not finish")


def _outputs(s: Any, req_id: str) -> list[int]:
    return list(s.requests[req_id].output_token_ids)


def test_a_lost_prefill_chunk_is_recomputed_from_the_validated_boundary() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", PROMPT, max_tokens=4))
    step(s)  # chunk 1: tokens 0..63, clean: blocks 0-3 validated and published
    blocks = _blocks(s, "a")
    lost = s.schedule()  # chunk 2: tokens 64..127, never reported back (the fault)
    assert lost.num_scheduled_tokens == {"a": 64}
    blocks = _blocks(s, "a")
    report = s.recover()
    assert report.resumed == (ResumedRequest("a", 64, 64),)
    assert report.ended == ()
    assert report.slots == tuple(SlotRange(b, 0, BLOCK) for b in blocks[4:8])
    assert s.requests["a"].num_computed_tokens == 64
    pool = s.kvguard_pool.core
    assert [pool.block_state(b) for b in blocks[:4]] == [BlockState.PUBLISHED] * 4
    assert [pool.block_state(b) for b in blocks[4:8]] == [BlockState.WRITTEN] * 4
    # The next step recomputes chunk 2 in the same blocks, after the workers wipe them.
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 64}
    assert so.kvguard_slots_to_zero == list(report.slots)
    assert _blocks(s, "a")[:8] == blocks[:8]
    s.update_from_output(so, model_output(s, so))
    assert [pool.block_state(b) for b in blocks[4:8]] == [BlockState.PUBLISHED] * 4
    assert not getattr(s.schedule(), "kvguard_slots_to_zero", None)  # sent once
    stats = s.kvguard_stats()
    assert (stats["requests_recovered"], stats["tokens_rolled_back"]) == (1, 64)


def test_recovered_requests_finish_with_their_fault_free_output() -> None:
    """Two requests, one mid-prefill and one decoding, lose a step; both finish with
    what a fault-free run gives them, and a later request hits the whole prompt."""
    outputs = {}
    for fault in (False, True):
        s = make_scheduler()
        s.add_request(make_request("a", PROMPT, max_tokens=6))
        s.add_request(make_request("b", PROMPT[:40], max_tokens=6))
        for _ in range(2):
            step(s)
        if fault:
            s.schedule()
            assert {r.request_id for r in s.recover().resumed} == {"a", "b"}
        assert _run_to_end(s) == {"a": "length", "b": "length"}
        s.add_request(make_request("c", PROMPT, max_tokens=2))
        so, _ = step(s)
        outputs[fault] = hit_tokens(so)
    assert outputs[True] == outputs[False] == {"c": 9 * BLOCK}


def test_a_partial_block_keeps_its_validated_prefix() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", PROMPT[:40], max_tokens=4))
    step(s)  # the prompt, clean: 1 output token
    s.schedule()  # decodes position 40 (block 2, holding tokens 32..39): lost
    third = _blocks(s, "a")[2]
    report = s.recover()
    assert report.resumed == (ResumedRequest("a", 40, 1),)
    assert report.slots == (SlotRange(third, 8, BLOCK),)
    request = s.requests["a"]
    assert (request.num_computed_tokens, request.num_output_tokens) == (40, 1)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.kvguard_slots_to_zero == [SlotRange(third, 8, BLOCK)]


def test_async_scheduling_drops_the_placeholders_of_both_steps_in_flight() -> None:
    s = make_scheduler(async_scheduling=True)
    s.add_request(make_request("a", PROMPT[:40], max_tokens=6))
    first = s.schedule()
    s.update_from_output(first, model_output(s, first))
    s.schedule()
    s.schedule()  # two decode steps in flight, both lost
    request = s.requests["a"]
    assert request.num_output_placeholders == 2
    (resumed,) = s.recover().resumed
    assert (resumed.boundary, resumed.rolled_back) == (40, 2)
    assert (request.num_computed_tokens, request.num_output_placeholders) == (40, 0)
    reasons: dict[str, str] = {}
    pending = []
    for _ in range(20):
        if not s.requests:
            break
        pending.append(s.schedule())
        if len(pending) == 2 or not s.requests:
            so = pending.pop(0)
            reasons.update(finish_reasons(s.update_from_output(so, model_output(s, so))))
    while pending:
        so = pending.pop(0)
        reasons.update(finish_reasons(s.update_from_output(so, model_output(s, so))))
    assert reasons == {"a": "length"}


def test_a_request_without_a_counted_step_cannot_resume(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    logger = scheduler_module.logger
    monkeypatch.setattr(logger, "propagate", False)
    logger.addHandler(caplog.handler)
    try:
        s = make_scheduler()
        s.add_request(make_request("a", PROMPT[:40], max_tokens=4))
        s.add_request(make_request("b", PROMPT[:40][::-1], max_tokens=4))
        so = s.schedule()
        out = model_output(s, so)
        del out.num_nans_in_logits["a"]  # a's step came back without a NaN count
        s.update_from_output(so, out)
        s.schedule()
        blocks = _blocks(s, "a")
        report = s.recover()
    finally:
        logger.removeHandler(caplog.handler)
    assert [r.request_id for r in report.resumed] == ["b"]
    ((request, why),) = report.ended
    assert request.request_id == "a" and "without a NaN count" in why
    assert str(request.get_finished_reason()) == "error"
    pool = s.kvguard_pool.core
    assert pool.block_state(blocks[2]) is BlockState.QUARANTINED
    (line,) = [
        r.getMessage()
        for r in caplog.records
        if r.name == logger.name and r.getMessage().startswith("kvguard: request")
    ]
    assert line.startswith("kvguard: request a cannot resume after the fault")
    assert s.kvguard_stats()["requests_unrecoverable"] == 1


def test_nothing_in_flight_is_nothing_to_do() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", PROMPT[:40]))
    step(s)
    assert s.recover() == type(s.recover())()
    assert s.recover(["a"]).resumed == ()


@pytest.mark.parametrize(
    ("ids", "error", "message"),
    [
        ("a", PoolMisuseError, r"takes an iterable of request ids, got the str 'a'; pass \['a'\]"),
        (["a", "zz"], UnknownRequestError, "holds no request 'zz'"),
        ([3], UnknownRequestError, "holds no request 3"),
    ],
)
def test_bad_ids_change_nothing(ids: Any, error: type[Exception], message: str) -> None:
    s = make_scheduler()
    s.add_request(make_request("a", PROMPT[:40]))
    s.schedule()
    before = (s.requests["a"].num_computed_tokens, s.kvguard_pool.core.snapshot())
    with pytest.raises(error, match=message):
        s.recover(ids)
    assert (s.requests["a"].num_computed_tokens, s.kvguard_pool.core.snapshot()) == before


def test_stock_vllm_has_no_recovery() -> None:
    """What vLLM's fault tolerance does instead (``on_fault``): abort every request."""
    s = make_scheduler(guarded=False)
    assert not hasattr(s, "recover")
    s.add_request(make_request("a", PROMPT, max_tokens=4))
    step(s)
    s.schedule()
    from vllm.v1.request import RequestStatus

    (aborted,) = s.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    assert str(aborted.get_finished_reason()) == "abort"


def test_a_request_whose_blocks_cannot_roll_back_ends_and_the_rest_resume(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Should kvguard's pool refuse a request's rollback (a block others can see: not
    expected), that request ends with an error and the others still resume."""
    from kvguard.errors import RollbackError

    s = make_scheduler()
    s.add_request(make_request("a", PROMPT[:40], max_tokens=4))
    s.add_request(make_request("b", PROMPT[:40][::-1], max_tokens=4))
    step(s)
    s.schedule()
    # The scheduler calls the core's recovery façade (slotted: patched on its class).
    recovery = type(s.kvguard_pool.core.recovery)
    stock = recovery.roll_back_blocks
    a_blocks = set(_blocks(s, "a"))

    def refuse_a(self: Any, tails: dict[int, int]) -> Any:
        if a_blocks & set(tails):
            raise RollbackError("block seen by others")
        return stock(self, tails)

    monkeypatch.setattr(recovery, "roll_back_blocks", refuse_a)
    report = s.recover()
    assert [r.request_id for r in report.resumed] == ["b"]
    ((request, why),) = report.ended
    assert request.request_id == "a" and why == (
        "its KV cannot be rolled back (block seen by others)"
    )
    assert set(s.requests) == {"b"}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_simulator_loses_and_recomputes_what_recover_does(async_scheduling: bool) -> None:
    """The real-engine trace of tests/e2e/test_recover.py (32-token blocks, 64 tokens a
    step; b decodes its token 40 while a prefills its tokens 24..86, and that step is
    lost), at scheduler level: what ``recover()`` rolls back, and what dropping the
    touched blocks and preempting (PR #50265) or resubmitting would recompute, equal
    what ``kvguard simulate``'s rank fault gives on the same trace, request by
    request. Async: the next step, in flight, is lost too."""
    from ..sim.lost_step import CHUNK, EXPECTED, MAX_TOKENS, prompts, recompute, run_trace
    from .recompute import recompute_costs

    size = 32
    s = make_scheduler(
        async_scheduling=async_scheduling, block_size=size, max_num_batched_tokens=CHUNK
    )
    for req_id, prompt in prompts().items():
        s.add_request(make_request(req_id, list(prompt), MAX_TOKENS, block_size=size))
    first = s.schedule()
    assert first.num_scheduled_tokens == {"b": 40, "a": 24}
    if async_scheduling:
        lost = s.schedule()
        s.update_from_output(first, model_output(s, first))
        assert s.schedule().num_scheduled_tokens == {"b": 1, "a": 63}  # lost too
    else:
        s.update_from_output(first, model_output(s, first))
        lost = s.schedule()
    assert lost.num_scheduled_tokens == {"b": 1, "a": 63}  # a's 24..86, b's 40
    costs = recompute_costs(s)
    report = s.recover()
    assert all(costs[r.request_id].rollback == r.rolled_back for r in report.resumed)
    in_vllm = {
        r.request_id: (r.rolled_back, costs[r.request_id].drop_blocks) for r in report.resumed
    }
    in_sim = recompute(run_trace("kvguard", async_scheduling=async_scheduling))
    assert in_vllm == in_sim == EXPECTED[async_scheduling]
    assert s.kvguard_stats()["tokens_rolled_back"] == sum(r for r, _ in in_vllm.values())
