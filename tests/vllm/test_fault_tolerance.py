"""vLLM's engine fault tolerance (``EngineCoreSentinel``) leaves the guard on.

On a fault in the engine's busy loop vLLM's sentinel aborts every request
(``on_fault``); vLLM 0.33 then drains the batch queue, feeding each drained step's
connector output to ``update_from_output`` with ``SchedulerOutput.make_empty()`` and
dropping the rest of it (0.32 clears the queue). The steps in flight at the fault never
report back. The guarded scheduler must resynchronise its step ledger on the next
real output -- not fall back to vLLM's unguarded path for good -- and keep its
bookkeeping bounded.

The sentinel here is vLLM's own class, on an engine stand-in that has exactly what
``on_fault`` and ``_drain_batch_queue`` read: the scheduler, the batch queue, and sinks
for the abort outputs and status pushes.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingWorkerMetadata,
)
from vllm.v1.fault_tolerance.engine_core_sentinel import EngineCoreSentinel  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

from .fault_sentinel import sentinel_over  # noqa: E402
from .harness import (  # noqa: E402
    BLOCK,
    connector_output,
    finish_reasons,
    make_request,
    make_scheduler,
    model_output,
    transfer_config,
)


def _done(value: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(value)
    return future


def _drain(sentinel: EngineCoreSentinel) -> None:
    """What ``retry`` does with the batch queue once the workers recovered (vLLM 0.33;
    0.32's ``on_fault`` cleared the queue already)."""
    drain = getattr(sentinel, "_drain_batch_queue", None)
    if drain is not None:
        drain()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_guard_stays_on_after_a_fault_tolerance_drain(async_scheduling: bool) -> None:
    s = make_scheduler(
        async_scheduling=async_scheduling,
        num_blocks=96,
        kv_transfer_config=transfer_config(),
    )
    ledger = s._kvguard_ledger
    # Before the fault: two requests mid-prefill, with steps in flight that never report.
    s.add_request(make_request("a", list(range(100, 100 + 5 * BLOCK)), max_tokens=4))
    s.add_request(make_request("b", list(range(300, 300 + 5 * BLOCK)), max_tokens=4))
    in_flight = [s.schedule()]
    if async_scheduling:
        first = in_flight.pop(0)
        s.update_from_output(first, connector_output(s, first))
        in_flight += [s.schedule(), s.schedule()]
    batch_queue: deque[Any] | None = None
    if async_scheduling:
        # As in EngineCore.step_with_batch_queue: newest on the left. The drained
        # outputs carry a connector report, so 0.33 hands them over as empty steps.
        batch_queue = deque(maxlen=2)
        for so in in_flight:
            out = connector_output(s, so)
            assert isinstance(out.kv_connector_output, KVConnectorOutput)
            out.kv_connector_output.kv_connector_worker_meta = OffloadingWorkerMetadata(
                completed_jobs={}
            )
            batch_queue.appendleft((_done(out), so, _done(None)))
    sentinel, engine = sentinel_over(s, batch_queue)
    sentinel.on_fault(RuntimeError("a worker died"))
    assert sorted(r.request_id for r in engine.aborted) == ["a", "b"]
    _drain(sentinel)
    assert not s.requests

    # After recovery: c is clean; d's second prefill chunk computes NaN.
    s.add_request(make_request("c", list(range(500, 500 + 3 * BLOCK)), max_tokens=4))
    s.add_request(make_request("d", list(range(700, 700 + 5 * BLOCK)), max_tokens=4))
    reasons: dict[str, str] = {}
    pending: list[Any] = []
    d_steps = 0
    for _ in range(30):
        so = s.schedule()
        pending.append(so)
        if async_scheduling and len(pending) < 2:
            continue
        done = pending.pop(0)
        nans = {}
        if "d" in done.num_scheduled_tokens:
            d_steps += 1
            if d_steps == 2:
                nans["d"] = 3
        reasons.update(finish_reasons(s.update_from_output(done, connector_output(s, done, nans))))
        # Bounded: the steps lost in the fault are dropped at the first output after
        # it; no record outlives the steps in flight.
        assert len(ledger) <= len(pending), len(ledger)
        if not s.requests and not pending:
            break
    assert reasons == {"c": "length", "d": "error"}
    assert s.kvguard_stats()["requests_aborted"] == 1
    assert s.kvguard_stats()["steps_lost"] == (2 if async_scheduling else 1)
    pool = s.kvguard_pool
    pool.core.check_invariants()
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert not s._kvguard_ledger.carried.fills and not s._kvguard_unchecked


def test_an_output_for_a_step_the_ledger_never_saw_is_still_checked() -> None:
    """An output whose SchedulerOutput the guard did not schedule (not expected) is
    still checked for NaN: a request with NaN logits is aborted, not served."""
    from vllm.v1.core.sched.output import SchedulerOutput

    s = make_scheduler()
    s.add_request(make_request("a", list(range(100, 100 + 2 * BLOCK)), max_tokens=4))
    so = s.schedule()
    assert s._kvguard_ledger.close(so) is not None  # the guard loses track of it
    out = s.update_from_output(so, model_output(s, so, {"a": 1}))
    assert finish_reasons(out) == {"a": "error"}
    # And an empty step (vLLM 0.33's fault-tolerance drain) is understood as one.
    nothing = SchedulerOutput.make_empty()
    empty = s.update_from_output(nothing, model_output(s, nothing))
    assert not finish_reasons(empty)
    assert len(s._kvguard_ledger) == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "stock"])
def test_with_the_plugin_a_fault_resumes_requests_instead_of_aborting_them(
    guarded: bool, async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kvguard's plugin wraps vLLM's ``on_fault``: on a guarded scheduler the abort of
    every request becomes ``recover()``; after the retry the requests run to the end.
    vLLM's own scheduler under the same patch: every request aborted, as without it."""
    from kvguard.adapters.vllm import plugin

    from .conftest import undo_plugin_patches_after

    undo_plugin_patches_after(monkeypatch)
    plugin._patch_fault_handler()
    s = make_scheduler(guarded=guarded, async_scheduling=async_scheduling)
    s.add_request(make_request("a", list(range(100, 100 + 5 * BLOCK)), max_tokens=4))
    s.add_request(make_request("b", list(range(300, 300 + 2 * BLOCK)), max_tokens=4))
    first = s.schedule()
    s.update_from_output(first, model_output(s, first))
    s.schedule()  # in flight at the fault, never reported back
    if async_scheduling:
        s.schedule()
    sentinel, engine = sentinel_over(s, deque() if async_scheduling else None)
    sentinel.on_fault(RuntimeError("a worker died"))
    if not guarded:
        assert sorted(r.request_id for r in engine.aborted) == ["a", "b"]
        assert not s.requests
        return
    assert engine.aborted == []
    assert set(s.requests) == {"a", "b"}
    assert s.kvguard_stats()["requests_recovered"] == 2
    reasons: dict[str, str] = {}
    pending: list[Any] = []
    for _ in range(30):
        if not s.requests and not pending:
            break
        if s.requests:
            pending.append(s.schedule())
        if async_scheduling and len(pending) < 2 and s.requests:
            continue
        done = pending.pop(0)
        reasons.update(finish_reasons(s.update_from_output(done, model_output(s, done))))
    assert reasons == {"a": "length", "b": "length"}
    pool = s.kvguard_pool
    pool.core.check_invariants()
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
