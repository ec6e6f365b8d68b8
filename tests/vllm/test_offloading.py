"""The offload gate: vLLM's OffloadingConnector (real scheduler side, real CPU offloading
manager) stores only validated blocks, and late acknowledgements are dropped.

The worker side of vLLM's CPU offloading needs a GPU; here a worker's report is what
it sends the scheduler: ``OffloadingWorkerMetadata.completed_jobs`` inside the step's
``KVConnectorOutput`` (vLLM's own offloading tests drive the scheduler the same way).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: E402
    OffloadingConnector,
)
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvguard import BlockHash, BlockState  # noqa: E402
from kvguard.adapters.vllm import plugin  # noqa: E402
from kvguard.adapters.vllm._compat import vllm_series  # noqa: E402
from kvguard.adapters.vllm.config import GuardConfigError  # noqa: E402
from kvguard.adapters.vllm.exits.offloading import (  # noqa: E402
    TIER,
    GuardedOffloadingConnector,
)

from .conftest import undo_plugin_patches_after  # noqa: E402
from .exit_rule import assert_may_leave  # noqa: E402
from .harness import (  # noqa: E402
    BLOCK,
    finish_reasons,
    make_request,
    make_scheduler,
    offloading_metadata,
    transfer_config,
)
from .harness import connector_output as output  # noqa: E402

PROMPT = list(range(1000, 1000 + 4 * BLOCK))  # 4 full blocks


def offload_scheduler(*, connector: str = "GuardedOffloadingConnector", **kwargs: Any) -> Any:
    return make_scheduler(kv_transfer_config=transfer_config(connector), **kwargs)


def store_blocks(so: Any) -> dict[int, list[int]]:
    """Store job id -> GPU blocks it copies, as sent to the workers."""
    jobs = offloading_metadata(so).store_jobs
    return {j: [int(b) for b in job.src_spec.block_ids] for j, job in jobs.items()}


def tier_state(s: Any, prompt: list[int]) -> list[LookupResult]:
    """What the CPU tier holds for each full block of ``prompt``."""
    manager = s.connector.connector_scheduler.manager
    probe = make_request("probe", prompt)
    ctx = ReqContext(req_id="probe")
    return [manager.lookup(make_offload_key(h, 0), ctx) for h in probe.block_hashes]


def kvguard_hash(prompt: list[int], index: int) -> BlockHash:
    block_hash = make_request("p", prompt).block_hashes[index]
    return BlockHash(make_block_hash_with_group_id(block_hash, 0))


HIT, MISS = LookupResult.HIT, LookupResult.MISS


def store_failures_reported() -> bool:
    return vllm_series() >= (0, 34)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_store_jobs_never_include_unvalidated_blocks(async_scheduling: bool) -> None:
    """Stock vLLM stores the chunk of the step being scheduled; the guarded connector
    stores each chunk once its step validated, and ends up storing the same chunks."""

    def run(connector: str, guarded: bool) -> tuple[list[dict[int, list[int]]], Any]:
        s = offload_scheduler(
            connector=connector,
            guarded=guarded,
            async_scheduling=async_scheduling,
            max_num_batched_tokens=BLOCK,
        )
        s.add_request(make_request("a", PROMPT, max_tokens=3))
        s.add_request(make_request("b", PROMPT[: 2 * BLOCK] + [7] * BLOCK, max_tokens=3))
        core = s.kvguard_pool.core if guarded else None
        jobs: list[dict[int, list[int]]] = []
        in_flight: list[Any] = []
        pending = s.connector.connector_scheduler._jobs
        for _ in range(100):
            if not s.requests and not pending:
                break
            so = s.schedule()
            built = store_blocks(so)
            jobs.append(built)
            if core is not None:
                for blocks in built.values():
                    assert_may_leave(core, blocks)
                s.kvguard_pool.check_consistency()
            in_flight.append(so)
            if async_scheduling and len(in_flight) < 2:
                continue  # the next step is scheduled before this one's output
            done = in_flight.pop(0)
            # Workers finish each store within the step after it was submitted.
            s.update_from_output(done, output(s, done, completed=store_blocks(done)))
        else:
            raise AssertionError("requests did not finish")
        for done in in_flight:
            s.update_from_output(done, output(s, done))
        return jobs, s

    stock_jobs, stock = run("OffloadingConnector", guarded=False)
    guarded_jobs, guarded = run("GuardedOffloadingConnector", guarded=True)
    # Stock: the first step's store job copies the block that very step writes.
    first = stock_jobs[0]
    assert first and all(first.values())
    assert not guarded_jobs[0], "nothing is validated before the first output"
    # Same chunks end up in the CPU tier.
    for prompt in (PROMPT, PROMPT[: 2 * BLOCK] + [7] * BLOCK):
        assert tier_state(stock, prompt) == tier_state(guarded, prompt)
        assert tier_state(guarded, prompt)[: len(prompt) // BLOCK] == [HIT] * (len(prompt) // BLOCK)
    stats = guarded.kvguard_stats()
    assert stats["offload_store_jobs_cancelled"] == 0
    assert stats["offload_chunks_discarded"] == stats["dropped_acks"] == 0
    # a's 4 chunks and b's third (its first two are a's).
    assert stats["offload_chunks_stored"] == stats["stores_acknowledged"] == 4 + 1
    assert guarded.kvguard_pool.core.tier_copies(kvguard_hash(PROMPT, 0)) == (TIER,)


@pytest.mark.parametrize("own_limit", [None, 2 * BLOCK])
def test_a_requests_own_max_offload_tokens_is_kept(own_limit: int | None) -> None:
    """kvguard's clamp rides on vLLM's per-request ``max_offload_tokens`` while store
    jobs are built: a request's own setting still caps what is stored, and reads the
    same after every step."""
    s = offload_scheduler(max_num_batched_tokens=BLOCK)
    request = make_request("a", PROMPT, max_tokens=2)
    if own_limit is not None:
        request.kv_transfer_params = {"max_offload_tokens": own_limit}
    s.add_request(request)
    status = s.connector.connector_scheduler._req_status
    completed: list[int] = []
    while s.requests:
        so = s.schedule()
        assert status["a"].max_offload_tokens == own_limit
        jobs = list(store_blocks(so))
        s.update_from_output(so, output(s, so, completed=completed))
        completed = jobs
    so = s.schedule()
    s.update_from_output(so, output(s, so, completed=completed))
    stored = 4 if own_limit is None else own_limit // BLOCK
    assert tier_state(s, PROMPT) == [HIT] * stored + [MISS] * (4 - stored)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_prefix_hit_is_offered_with_the_requests_own_chunks(
    async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request admitted on a prefix hit has its hit chunks offered to the tier in
    the same ``prepare_store`` call as its own first chunks -- once those validated --
    as stock vLLM offers them together at admission; not one call early for the hits
    alone."""

    def offers(connector: str, guarded: bool) -> list[int]:
        s = offload_scheduler(
            connector=connector, guarded=guarded, async_scheduling=async_scheduling
        )
        manager = s.connector.connector_scheduler.manager
        calls: list[int] = []
        prepare_store = manager.prepare_store

        def counted(keys: Any, req_context: Any) -> Any:
            if req_context.req_id == "b":
                calls.append(len(list(keys)))
            return prepare_store(keys, req_context)

        monkeypatch.setattr(manager, "prepare_store", counted)
        s.add_request(make_request("a", PROMPT[: 2 * BLOCK], max_tokens=1))
        pending: list[Any] = []
        completed: list[int] = []
        for t in range(12):
            if t == 3:  # a's blocks are cached: b hits both
                s.add_request(make_request("b", PROMPT[: 2 * BLOCK] + [7] * BLOCK, max_tokens=1))
            pending.append(s.schedule())
            if async_scheduling and len(pending) < 2:
                continue
            so = pending.pop(0)
            jobs = list(store_blocks(so))
            s.update_from_output(so, output(s, so, completed=completed))
            completed = jobs
        assert "b" not in s.requests
        return calls

    assert offers("OffloadingConnector", guarded=False) == [3]
    assert offers("GuardedOffloadingConnector", guarded=True) == [3]


def test_failed_request_stores_its_validated_chunks_only_and_they_hit() -> None:
    s = offload_scheduler(max_num_batched_tokens=BLOCK)
    core = s.kvguard_pool.core
    s.add_request(make_request("a", PROMPT))
    so1 = s.schedule()
    assert store_blocks(so1) == {}
    s.update_from_output(so1, output(s, so1))
    so2 = s.schedule()
    (job0,) = store_blocks(so2)  # chunk 0, validated by step 1
    s.update_from_output(so2, output(s, so2))  # its copy is still running
    so3 = s.schedule()
    (job1,) = store_blocks(so3)  # chunk 1, validated by step 2
    out = s.update_from_output(so3, output(s, so3, {"a": 4}))  # chunk 2 is NaN
    assert finish_reasons(out) == {"a": "error"}
    # The next steps: the failed request's last chance to store (finished_req_ids)
    # offers nothing; the earlier chunks' copies finish after the abort.
    so4 = s.schedule()
    assert so4.finished_req_ids == {"a"}
    assert store_blocks(so4) == {}
    s.update_from_output(so4, output(s, so4, completed=[job0, job1]))
    assert tier_state(s, PROMPT) == [HIT, HIT, MISS, MISS]
    assert core.tier_copies(kvguard_hash(PROMPT, 1)) == (TIER,)
    assert core.tier_copies(kvguard_hash(PROMPT, 2)) == ()
    assert s.kvguard_stats()["dropped_acks"] == 0
    # A retry after the GPU prefix cache was dropped loads the two validated
    # chunks from the CPU tier and recomputes only the rest.
    assert s.reset_prefix_cache()
    s.add_request(make_request("retry", PROMPT))
    so5 = s.schedule()
    (load,) = so5.kv_connector_metadata.load_jobs.values()
    assert len(load.src_spec.block_ids) == 2
    assert s.requests["retry"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    (load_id,) = so5.kv_connector_metadata.load_jobs
    s.update_from_output(so5, output(s, so5, completed=[load_id], recved=["retry"]))
    assert s.requests["retry"].num_computed_tokens == 2 * BLOCK  # loaded
    so6 = s.schedule()
    assert so6.num_scheduled_tokens == {"retry": BLOCK}
    s.update_from_output(so6, output(s, so6))
    s.kvguard_pool.check_consistency()


def _finish_and_offer(s: Any, prompt: list[int]) -> tuple[Any, int]:
    """Request "a" prefills ``prompt`` in one step and finishes; the next step offers
    its blocks for storing. Returns that step's output and the store job."""
    s.add_request(make_request("a", prompt, max_tokens=1))
    so = s.schedule()
    out = s.update_from_output(so, output(s, so))
    assert finish_reasons(out) == {"a": "length"}
    so = s.schedule()
    (job,) = store_blocks(so)
    return so, job


def test_late_ack_after_the_blocks_were_reused_is_dropped() -> None:
    s = offload_scheduler(num_blocks=4)  # 3 usable blocks
    core = s.kvguard_pool.core
    prompt = PROMPT[: 2 * BLOCK]
    so, job = _finish_and_offer(s, prompt)
    copied = store_blocks(so)[job]
    s.update_from_output(so, output(s, so))  # the copy is still running
    # Another request needs every block: a's cached blocks are evicted and reused.
    s.add_request(make_request("b", list(range(9000, 9000 + 3 * BLOCK))))
    so = s.schedule()
    (table,) = s.kv_cache_manager.get_block_ids("b")
    assert set(copied) <= set(table)
    assert job in so.kv_connector_metadata.jobs_to_flush  # vLLM fences the reuse
    s.update_from_output(so, output(s, so, completed=[job]))  # the ack arrives late
    assert tier_state(s, prompt) == [MISS, MISS]  # discarded, not loadable
    assert core.tier_copies(kvguard_hash(prompt, 0)) == ()
    stats = s.kvguard_stats()
    assert stats["dropped_acks"] == 2
    assert stats["offload_chunks_discarded"] == 2
    assert stats["offload_chunks_stored"] == 0
    s.kvguard_pool.check_consistency()


def test_late_ack_after_invalidation_is_dropped() -> None:
    s = offload_scheduler()
    core = s.kvguard_pool.core
    prompt = PROMPT[: 3 * BLOCK]
    so, job = _finish_and_offer(s, prompt)
    s.update_from_output(so, output(s, so))
    # Block 1 is found corrupt after the fact, while the copy runs: it and its
    # descendant (block 2) are tainted; block 0 is not.
    report = core.invalidate([kvguard_hash(prompt, 1)])
    assert len(report.block_ids) == 2
    so = s.schedule()
    s.update_from_output(so, output(s, so, completed=[job]))
    assert tier_state(s, prompt) == [HIT, MISS, MISS]
    assert core.tier_copies(kvguard_hash(prompt, 0)) == (TIER,)
    assert {core.block_state(b) for b in report.block_ids} == {BlockState.QUARANTINED}
    assert s.kvguard_stats()["dropped_acks"] == 2


def test_unvalidated_block_in_a_store_job_cancels_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Second line: a job vLLM builds with a block kvguard refuses never reaches a
    worker (one WARNING under vLLM's logger says so), and its chunks are offered again
    once they validated."""
    from kvguard.adapters.vllm.exits import offloading

    logger = offloading.logger
    assert logger.name == "vllm.kvguard.adapters.vllm.exits.offloading"
    monkeypatch.setattr(logger, "propagate", False)  # (vLLM's logger stops it anyway)
    logger.addHandler(caplog.handler)
    s = offload_scheduler(max_num_batched_tokens=BLOCK)
    cs = s.connector.connector_scheduler
    try:
        with monkeypatch.context() as m:
            m.setattr(cs, "_kvguard_validated_tokens", lambda req_id, req_status: 10**9)
            s.add_request(make_request("a", PROMPT[: 2 * BLOCK]))
            so = s.schedule()
    finally:
        logger.removeHandler(caplog.handler)
    (line,) = [r.getMessage() for r in caplog.records if r.name == logger.name]
    assert line.startswith("kvguard: store job ") and "of request a copies block" in line
    assert line.endswith("which is not validated; the job is cancelled")
    assert store_blocks(so) == {}
    assert not cs._jobs and not cs._req_status["a"].transfer_jobs
    assert tier_state(s, PROMPT[: 2 * BLOCK]) == [MISS, MISS]
    assert s.kvguard_stats()["offload_store_jobs_cancelled"] == 1
    assert s.kvguard_stats()["stores_started"] == 0
    s.update_from_output(so, output(s, so))
    so = s.schedule()
    (job,) = store_blocks(so)  # chunk 0 again, validated now
    s.update_from_output(so, output(s, so, completed=[job]))
    assert tier_state(s, PROMPT[: 2 * BLOCK])[0] is HIT


@pytest.mark.skipif(
    not store_failures_reported(), reason="vLLM reports failed store jobs from 0.34 on"
)
def test_a_store_the_workers_report_failed_is_no_tier_copy() -> None:
    """vLLM 0.34's workers report a store job that failed; vLLM drops its copies, and
    kvguard fails its tickets: no tier copy recorded, nothing counted as stored, and
    the chunk is offered again in no later job (vLLM's pointer moved past it)."""
    s = offload_scheduler()
    core = s.kvguard_pool.core
    prompt = PROMPT[: 2 * BLOCK]
    so, job = _finish_and_offer(s, prompt)
    s.update_from_output(so, output(s, so))  # the copy is running
    so = s.schedule()
    s.update_from_output(so, output(s, so, completed=[job], failed=[job]))
    assert tier_state(s, prompt) == [MISS, MISS]  # vLLM dropped them
    assert core.tier_copies(kvguard_hash(prompt, 0)) == ()
    assert core.tier_copies(kvguard_hash(prompt, 1)) == ()
    counters = core.stats().counters
    assert counters.stores_failed == 2 and counters.stores_acknowledged == 0
    stats = s.kvguard_stats()
    assert stats["offload_store_jobs_failed"] == 1
    assert stats["offload_chunks_stored"] == 0
    assert not s.connector.connector_scheduler.kvguard_in_flight()
    s.kvguard_pool.check_consistency()


def test_cache_reset_fails_the_tickets_in_flight() -> None:
    s = offload_scheduler()
    core = s.kvguard_pool.core
    so, job = _finish_and_offer(s, PROMPT[: 2 * BLOCK])
    s.update_from_output(so, output(s, so))
    assert s.connector.connector_scheduler.kvguard_in_flight()
    assert s.reset_prefix_cache(reset_connector=True)
    assert not s.connector.connector_scheduler.kvguard_in_flight()
    counters = core.stats().counters
    assert counters.stores_failed == 2 and counters.stores_acknowledged == 0
    so = s.schedule()  # the flushed job's report arrives; it is stale now
    s.update_from_output(so, output(s, so, completed=[job]))
    assert s.kvguard_stats()["dropped_acks"] == 0


def test_kvguards_record_of_tier_copies_follows_the_tiers_evictions_and_reset() -> None:
    """Many prompts through a CPU tier too small for them: the tier evicts chunks to
    make room, and kvguard forgets their copies -- ``tier_copies`` agrees with the
    tier block for block, and its record stays the tier's size."""
    s = offload_scheduler(num_blocks=64)
    core = s.kvguard_pool.core
    prompts = [list(range(10_000 + 100 * i, 10_000 + 100 * i + 2 * BLOCK)) for i in range(200)]
    completed: list[int] = []
    for i, prompt in enumerate(prompts):
        s.add_request(make_request(f"r{i}", prompt, max_tokens=1))
        so = s.schedule()
        jobs = list(store_blocks(so))  # (the previous request's chunks)
        s.update_from_output(so, output(s, so, completed=completed))
        completed = jobs
    so = s.schedule()
    s.update_from_output(so, output(s, so, completed=completed))

    held = recorded = 0
    for prompt in prompts:
        for index, state in enumerate(tier_state(s, prompt)):
            copies = core.tier_copies(kvguard_hash(prompt, index))
            assert copies == ((TIER,) if state is HIT else ()), (prompt[0], index, state)
            held += state is HIT
            recorded += bool(copies)
    assert 0 < held < 2 * len(prompts), "the tier evicted some chunks and holds others"
    stats = s.kvguard_stats()
    assert stats["offload_chunks_evicted"] == stats["offload_chunks_stored"] - held > 0
    assert recorded == held
    assert len(core.snapshot().tier_copies) == held

    assert s.reset_prefix_cache(reset_connector=True)
    assert core.snapshot().tier_copies == ()
    assert all(tier_state(s, prompt) == [MISS, MISS] for prompt in prompts)


def test_without_kvguards_pool_it_is_vllms_connector() -> None:
    for kvguard in ({"enabled": False}, None):
        if kvguard is None:
            s = offload_scheduler(guarded=False, max_num_batched_tokens=BLOCK)
        else:
            s = offload_scheduler(kvguard=kvguard, max_num_batched_tokens=BLOCK)
        assert isinstance(s.connector, GuardedOffloadingConnector)
        s.add_request(make_request("a", PROMPT))
        assert store_blocks(s.schedule())  # stock behaviour: stores at schedule time


@pytest.fixture
def plugin_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    undo_plugin_patches_after(monkeypatch)
    monkeypatch.setenv("KVGUARD_GUARD", "1")
    plugin.register()
    plugin.register()
    yield


@pytest.mark.usefixtures("plugin_on")
def test_plugin_selects_the_guarded_connector() -> None:
    stock = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(stock) is GuardedOffloadingConnector
    by_name = KVTransferConfig(kv_connector="GuardedOffloadingConnector", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(by_name) is GuardedOffloadingConnector
    other = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(other) is not GuardedOffloadingConnector
    s = offload_scheduler(connector="OffloadingConnector")
    assert isinstance(s.connector, GuardedOffloadingConnector)
    assert issubclass(GuardedOffloadingConnector, OffloadingConnector)
    # Inside a MultiConnector too (vLLM resolves its children through the factory).
    s = make_scheduler(kv_transfer_config=transfer_config("OffloadingConnector", multi=True))
    (child,) = s.connector.sub_connectors
    assert isinstance(child, GuardedOffloadingConnector)


@pytest.mark.parametrize("multi", [False, True], ids=["alone", "multi"])
def test_guarded_scheduler_refuses_the_stock_connector(multi: bool) -> None:
    """vLLM's own OffloadingConnector under a guarded scheduler picked by hand (no
    plugin to substitute it) would copy unvalidated KV: the engine refuses to start,
    naming the gated class; stock vLLM starts with it."""
    config = transfer_config("OffloadingConnector", multi=multi)
    with pytest.raises(GuardConfigError, match="kv_connector='GuardedOffloadingConnector'"):
        make_scheduler(kv_transfer_config=config)
    stock = make_scheduler(kv_transfer_config=config, guarded=False)
    connectors = getattr(stock.connector, "sub_connectors", [stock.connector])
    assert [type(c) for c in connectors] == [OffloadingConnector]


def test_package_exports_the_connector() -> None:
    import kvguard.adapters.vllm as adapter

    assert adapter.GuardedOffloadingConnector is GuardedOffloadingConnector


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_kv_load_failure_keeps_vllms_handling_and_publishes_nothing_unloaded(
    policy: str,
) -> None:
    """A load from the CPU tier fails for its second block (the worker reports it in
    ``invalid_block_ids``): the guarded scheduler takes vLLM's decisions -- the
    request fails under ``fail``, recomputes from the failed block under
    ``recompute`` -- and the block the load did not fill is never published; after
    the recompute it is validated like any block its step filled."""

    def run(guarded: bool) -> tuple[list[object], Any]:
        s = make_scheduler(
            guarded=guarded,
            kv_transfer_config=transfer_config(
                "GuardedOffloadingConnector" if guarded else "OffloadingConnector",
                load_failure_policy=policy,
            ),
        )
        s.add_request(make_request("a", PROMPT, max_tokens=1))
        for _ in range(3):  # a runs; its blocks are stored (the workers finish at once)
            so = s.schedule()
            s.update_from_output(so, output(s, so, completed=store_blocks(so)))
        assert tier_state(s, PROMPT) == [HIT] * 4
        assert s.reset_prefix_cache()
        s.add_request(make_request("retry", PROMPT + [7] * 5, max_tokens=2))
        so = s.schedule()
        ((load_id, load),) = so.kv_connector_metadata.load_jobs.items()
        dst = [int(b) for b in load.dst_spec.block_ids]
        assert len(dst) == 4
        trace: list[object] = []
        out = s.update_from_output(
            so, output(s, so, completed=[load_id], recved=["retry"], invalid=dst[1:2])
        )
        trace.append(finish_reasons(out))
        recomputing = guarded and policy == "recompute"
        for i in range(4):
            so = s.schedule()
            trace.append(dict(so.num_scheduled_tokens))
            if recomputing and i == 0:
                # The step recomputing it is scheduled: still not a hit.
                assert s.kvguard_pool.core.block_state(dst[1]) is BlockState.WRITTEN
            out = s.update_from_output(so, output(s, so))
            trace.append(finish_reasons(out))
            if recomputing and i == 0:  # that step's clean output validated it
                assert s.kvguard_pool.core.block_state(dst[1]) is BlockState.PUBLISHED
        return trace, s

    stock_trace, _ = run(guarded=False)
    guarded_trace, s = run(guarded=True)
    assert guarded_trace == stock_trace
    if policy == "fail":
        assert stock_trace[0] == {"retry": "error"}
    else:
        assert stock_trace[1] == {"retry": 3 * BLOCK + 5}  # recomputed from block 1
        assert {"retry": "length"} in stock_trace
    s.kvguard_pool.check_consistency()
    stats = s.kvguard_stats()
    assert stats["blocks_quarantined"] == 0
