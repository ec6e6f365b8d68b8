"""The SimpleCPU offload gate: vLLM's SimpleCPUOffloadConnector (its real scheduler side,
its real CPU block pool) stores only validated blocks, in eager and lazy mode, and a copy
that finishes after its block was quarantined is not registered in the CPU tier.

SimpleCPU's worker side needs CUDA; here the test plays the workers: it reads the block
lists each step's ``SimpleCPUOffloadMetadata`` sends them and reports what they report --
a store event done (``SimpleCPUOffloadWorkerMetadata.completed_store_events``) and the
requests whose load event finished (``finished_recving``) -- in a step's
``KVConnectorOutput``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (  # noqa: E402
    MultiKVConnectorMetadata,
    MultiKVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (  # noqa: E402
    SimpleCPUOffloadConnector,
)
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
)
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvguard import BlockHash, BlockState  # noqa: E402
from kvguard.adapters.vllm import GuardModeUnsupported, plugin  # noqa: E402
from kvguard.adapters.vllm._compat import vllm_series  # noqa: E402
from kvguard.adapters.vllm.config import GuardConfigError  # noqa: E402
from kvguard.adapters.vllm.exits import simple_cpu as simple_cpu_module  # noqa: E402
from kvguard.adapters.vllm.exits.simple_cpu import (  # noqa: E402
    TIER,
    GuardedSimpleCPUOffloadConnector,
    GuardedSimpleCPUOffloadScheduler,
)
from kvguard.adapters.vllm.scheduler import guarded as scheduler_module  # noqa: E402
from kvguard.adapters.vllm.scheduler.guarded import GuardedAsyncScheduler, GuardedScheduler  # noqa: E402
from kvguard.errors import IllegalTransitionError  # noqa: E402

from .conftest import undo_plugin_patches_after  # noqa: E402
from .exit_rule import may_leave  # noqa: E402
from .harness import (  # noqa: E402
    BLOCK,
    finish_reasons,
    make_request,
    make_vllm_config,
    model_output,
    records_of,
    tensor_backed_kv_cache_config,
)

PROMPT = list(range(1000, 1000 + 4 * BLOCK))  # 4 full blocks
GUARDED = "GuardedSimpleCPUOffloadConnector"
STOCK = "SimpleCPUOffloadConnector"
MODES = pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
SCHEDULING = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def names_tier_size() -> bool:
    """vLLM 0.33+ sizes the scheduler's CPU tier from the workers for the stock name
    only; a test naming the guarded class gives the size (``num_cpu_blocks``)."""
    return vllm_series() >= (0, 33)


def transfer_config(
    connector: str,
    *,
    lazy: bool,
    cpu_blocks: int,
    page: int,
    multi: bool = False,
    tier_size: bool = True,
) -> KVTransferConfig:
    """SimpleCPU offloading's config: a CPU tier of ``cpu_blocks`` blocks of ``page``
    bytes; the guarded class named directly is given its size (``tier_size``) where
    vLLM's engine would not (see :func:`names_tier_size`)."""
    extra: dict[str, Any] = {"cpu_bytes_to_use": page * cpu_blocks, "lazy_offload": lazy}
    if connector == GUARDED and names_tier_size() and tier_size:
        extra["num_cpu_blocks"] = cpu_blocks
    child = {
        "kv_connector": connector,
        "kv_role": "kv_both",
        "kv_connector_module_path": (
            "kvguard.adapters.vllm.exits.simple_cpu" if connector == GUARDED else None
        ),
        "kv_connector_extra_config": extra,
    }
    if multi:
        return KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"connectors": [child]},
        )
    return KVTransferConfig(**child)


def simple_cpu_scheduler(
    *,
    guarded: bool = True,
    connector: str | None = None,
    lazy: bool = False,
    async_scheduling: bool = False,
    num_blocks: int = 32,
    cpu_blocks: int = 64,
    max_num_batched_tokens: int = BLOCK,
    multi: bool = False,
    kvguard: Mapping[str, Any] | None = None,
    tier_size: bool = True,
) -> Any:
    """A real scheduler with SimpleCPU offloading: guarded (kvguard's scheduler and the
    gated connector) or stock (vLLM's scheduler and connector: the guard off). Its KV
    cache config has tensors: SimpleCPU sizes its CPU tier from them."""
    if connector is None:
        connector = GUARDED if guarded else STOCK
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    page = spec.page_size_bytes
    vllm_config = make_vllm_config(
        num_blocks=num_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        async_scheduling=async_scheduling,
        kv_transfer_config=transfer_config(
            connector,
            lazy=lazy,
            cpu_blocks=cpu_blocks,
            page=page,
            multi=multi,
            tier_size=tier_size,
        ),
        kvguard=kvguard,
    )
    kv_cache_config = tensor_backed_kv_cache_config(spec, num_blocks)
    if guarded:
        cls: type = GuardedAsyncScheduler if async_scheduling else GuardedScheduler
    else:
        cls = AsyncScheduler if async_scheduling else Scheduler
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
        log_stats=True,
    )


def connector_of(s: Any) -> Any:
    """The scheduler's SimpleCPU connector (a MultiConnector's child, if any)."""
    connector = s.connector
    for child in getattr(connector, "sub_connectors", ()):
        if isinstance(child, SimpleCPUOffloadConnector):
            return child
    return connector


def manager_of(s: Any) -> Any:
    return connector_of(s).scheduler_manager


def simple_cpu_metadata(so: Any) -> Any:
    meta = so.kv_connector_metadata
    return meta.metadata[0] if isinstance(meta, MultiKVConnectorMetadata) else meta


def kvguard_hash(prompt: list[int], index: int) -> BlockHash:
    return BlockHash(
        make_block_hash_with_group_id(make_request("p", prompt).block_hashes[index], 0)
    )


def in_cpu_tier(s: Any, prompt: list[int]) -> list[bool]:
    """Whether the CPU tier holds (can load) each full block of ``prompt``."""
    cpu_pool = manager_of(s).cpu_block_pool
    return [
        cpu_pool.cached_block_hash_to_block.get_one_block(kvguard_hash(prompt, i)) is not None
        for i in range(len(prompt) // BLOCK)
    ]


@dataclass
class Workers:
    """What SimpleCPU's workers do and report, played by the test.

    A store event is reported done in the output of the step that sent it (the copy
    runs after that step's forward, ``wait_for_save``), unless held; a load event's
    requests are reported in the output of the step that sent it. Every store event's
    blocks are recorded as the scheduler's pool knew them when the event was sent."""

    scheduler: Any
    held: set[int] = field(default_factory=set)
    """Store events whose completion the test reports itself (``release``)."""
    stored: list[tuple[int, Any, Any]] = field(default_factory=list)
    """(GPU block, its hash, its kvguard state) of every block a store event copied."""
    sent: dict[int, int] = field(default_factory=dict)
    """Store event -> the step output it is reported in (not yet reported)."""
    released: set[int] = field(default_factory=set)

    def observe(self, so: Any) -> None:
        meta = simple_cpu_metadata(so)
        if meta.store_event < 0:
            return
        pool = self.scheduler.kv_cache_manager.block_pool
        core = getattr(pool, "core", None)
        for block_id in meta.store_gpu_blocks:
            block = pool.blocks[block_id]
            state = core.block_state(block_id) if core is not None else None
            self.stored.append((block_id, block.block_hash, state))
        self.sent[meta.store_event] = id(so)

    def output(self, so: Any, nans: Mapping[str, int] | None = None) -> Any:
        meta = simple_cpu_metadata(so)
        done = [e for e, when in self.sent.items() if when == id(so) and e not in self.held]
        done += sorted(self.released)
        self.released.clear()
        for event in done:
            self.sent.pop(event, None)
        recved = {r for reqs in meta.load_event_to_reqs.values() for r in reqs}
        recved = {r for r in recved if r in self._loading()}
        mo = model_output(self.scheduler, so, nans)
        worker_meta: Any = SimpleCPUOffloadWorkerMetadata(
            completed_store_events=dict.fromkeys(done, 1)
        )
        if isinstance(so.kv_connector_metadata, MultiKVConnectorMetadata):
            worker_meta = MultiKVConnectorWorkerMetadata(metadata=(worker_meta,))
        mo.kv_connector_output = KVConnectorOutput(
            finished_recving=recved or None, kv_connector_worker_meta=worker_meta
        )
        return mo

    def _loading(self) -> set[str]:
        manager = manager_of(self.scheduler)
        return {r for r, state in manager._reqs_to_load.items() if state.load_event is not None}

    def release(self, event: int) -> None:
        self.held.discard(event)
        self.released.add(event)


@dataclass
class Driver:
    """Drives a scheduler step by step (one output in flight under async scheduling),
    the workers played by :class:`Workers`."""

    scheduler: Any
    async_scheduling: bool = False
    workers: Workers = field(init=False)
    pending: list[Any] = field(default_factory=list)
    finished: dict[str, str] = field(default_factory=dict)
    steps: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workers = Workers(self.scheduler)

    def step(self, nans: Mapping[str, int] | None = None) -> Any:
        """Schedule a step; process the oldest output due (NaN counts ``nans``)."""
        so = self.schedule()
        self.process_due(nans)
        return so

    def schedule(self) -> Any:
        """Schedule a step and leave its output in flight."""
        so = self.scheduler.schedule()
        self.steps.append(so)
        self.workers.observe(so)
        self.pending.append(so)
        return so

    def process_due(self, nans: Mapping[str, int] | None = None) -> None:
        """Process the oldest output if it is due (sync: always; async: with the next
        step scheduled)."""
        if not self.async_scheduling or len(self.pending) == 2:
            self.process(nans)

    def process(self, nans: Mapping[str, int] | None = None) -> None:
        """Process the oldest output in flight."""
        s = self.scheduler
        done = self.pending.pop(0)
        out = s.update_from_output(done, self.workers.output(done, nans))
        self.finished.update(finish_reasons(out))
        pool = s.kv_cache_manager.block_pool
        if hasattr(pool, "check_consistency"):
            pool.check_consistency()

    def flush(self) -> None:
        while self.pending:
            self.process()

    def drain(self, steps: int = 12) -> None:
        """Run until no request is left and no store is in flight (at most ``steps``
        steps), then process every output in flight."""
        s = self.scheduler
        for _ in range(steps):
            if not s.requests and not manager_of(s).has_pending_stores():
                break
            self.step()
        self.flush()

    def idle(self, steps: int) -> None:
        """Steps with nothing scheduled (lazy mode walks the free queue in each)."""
        for _ in range(steps):
            self.step()
        self.flush()

    def run(self, request: Any, nans_at: Mapping[int, Mapping[str, int]] | None = None) -> None:
        """Add ``request``, run it to its end; ``nans_at``: the NaN counts of its
        outputs, by their index (0: its first step's)."""
        self.flush()
        self.scheduler.add_request(request)
        outputs = 0
        for _ in range(40):
            if request.request_id in self.finished:
                break
            due = not self.async_scheduling or len(self.pending) == 1
            self.step((nans_at or {}).get(outputs) if due else None)
            outputs += due
        else:
            raise AssertionError(f"request {request.request_id} did not finish")
        self.drain()


def assert_stored_validated_only(driver: Driver) -> None:
    """Every block a store event copied was validated, carrying a hash, and no hash was
    copied twice."""
    hashes = [block_hash for _, block_hash, _ in driver.workers.stored]
    assert all(may_leave(state) for _, _, state in driver.workers.stored), driver.workers.stored
    assert None not in hashes
    assert len(hashes) == len(set(hashes)), hashes


# ---------------------------------------------------------------------- the free queue


def test_kvguards_free_queue_reads_as_vllms_free_list() -> None:
    """What vLLM code walks of ``free_block_queue`` (``iter_blocks_after``: SimpleCPU's
    lazy mode) is kvguard's free queue in hand-out order: quarantined blocks (no hash),
    then empty ones, then cached ones oldest first; it resumes after a cursor; the rest
    of vLLM's list (its links, its count, its writes) is refused."""
    s = simple_cpu_scheduler(num_blocks=10, max_num_batched_tokens=4 * BLOCK)
    pool = s.kvguard_pool
    queue = pool.free_block_queue
    d = Driver(s)
    d.run(make_request("a", PROMPT[: 2 * BLOCK], max_tokens=1))
    d.run(make_request("b", PROMPT[2 * BLOCK :] + [5] * BLOCK, max_tokens=1), {0: {"b": 1}})
    order = list(queue.iter_blocks_after(None))
    assert len(order) == pool.get_num_free_blocks()
    states = [b.state for b in order]
    cached = {BlockState.PUBLISHED, BlockState.OFFLOADED}
    first_cached = next(i for i, state in enumerate(states) if state in cached)
    assert set(states[: states.index(BlockState.FREE)]) == {BlockState.QUARANTINED}
    assert set(states[first_cached:]) <= cached
    assert all(b.ref_cnt == 0 and not b.is_null for b in order)
    assert all(b.block_hash is None for b in order[:first_cached])
    assert all(b.block_hash is not None for b in order[first_cached:])
    # The order kvguard hands blocks out in.
    assert [b.block_id for b in order[:3]] == pool.core.allocate_blocks(3)
    pool.core.release_blocks([b.block_id for b in order[:3]])
    order = list(queue.iter_blocks_after(None))
    for i, cursor in enumerate(order):
        assert list(queue.iter_blocks_after(cursor)) == order[i + 1 :]
    held = pool.get_new_blocks(1)[0]
    assert list(queue.iter_blocks_after(held)) == []  # not queued: no successor
    for other in ("popleft", "remove", "append_n", "fake_free_list_head", "num_free_blocks"):
        with pytest.raises(GuardModeUnsupported, match=f"free_block_queue.{other}"):
            getattr(queue, other)


def test_a_connectors_pin_on_a_held_block_holds_it_until_both_release() -> None:
    """SimpleCPU pins (``touch``) the blocks a load writes into, which its request
    holds and is writing: kvguard gives a block being written one owner, so the pin is
    a reference it does not count -- the first release is skipped, the second frees."""
    pool = simple_cpu_scheduler().kvguard_pool
    (block,) = pool.get_new_blocks(1)
    state = pool.core.block_state
    assert state(block.block_id) is BlockState.WRITTEN
    pool.touch([block])
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and state(block.block_id) is BlockState.WRITTEN
    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert state(block.block_id) is BlockState.QUARANTINED  # never validated
    assert not pool.retentions
    with pytest.raises(IllegalTransitionError):
        pool.touch([block])  # neither cached nor held: nothing to pin
    pool.check_consistency()


# ---------------------------------------------------------------------- the gate matters


@MODES
def test_stock_vllm_stores_a_nan_requests_blocks(lazy: bool) -> None:
    """The guard off (vLLM's scheduler and SimpleCPU connector): the blocks a step
    with NaN logits wrote reach the CPU tier, and a later request loads them. Guarded,
    none of them does."""
    prompt = PROMPT
    for guarded in (False, True):
        s = simple_cpu_scheduler(
            guarded=guarded, lazy=lazy, num_blocks=8, max_num_batched_tokens=2 * BLOCK
        )
        d = Driver(s)
        # Prefill in two steps; the second (blocks 2 and 3) has NaN logits.
        d.run(make_request("a", prompt, max_tokens=2), {1: {"a": 3}})
        d.run(make_request("filler", list(range(5000, 5000 + 6 * BLOCK)), max_tokens=1))
        if guarded:
            assert d.finished["a"] == "error"
            assert in_cpu_tier(s, prompt)[2:] == [False, False]
            assert_stored_validated_only(d)
        else:
            assert d.finished["a"] == "length"  # vLLM only counts NaN
            assert in_cpu_tier(s, prompt)[2:] == [True, True]
            # ... and serves them: a same-prompt request loads the NaN blocks.
            s.add_request(make_request("again", prompt, max_tokens=1))
            so = s.schedule()
            loaded = set(simple_cpu_metadata(so).load_cpu_blocks)
            cpu_pool = manager_of(s).cpu_block_pool
            nan_block = cpu_pool.cached_block_hash_to_block.get_one_block(kvguard_hash(prompt, 2))
            assert nan_block.block_id in loaded


def lazy_scenario(guarded: bool, async_scheduling: bool) -> tuple[list[bool], list[bool]]:
    """Lazy SimpleCPU on a 16-block GPU pool, 2-block prefill chunks, a CPU tier of 8
    blocks: a clean request "a" of 6 full blocks + 5 tokens runs to its end; then "b",
    5 blocks, whose second prefill chunk (its blocks 2 and 3) has NaN logits; then "c",
    12 blocks, takes the pool, evicting a's cached blocks. Returns which of a's full
    blocks and which of b's a store event copied."""
    s = simple_cpu_scheduler(
        guarded=guarded,
        lazy=True,
        async_scheduling=async_scheduling,
        num_blocks=16,
        cpu_blocks=8,
        max_num_batched_tokens=2 * BLOCK,
    )
    d = Driver(s, async_scheduling)
    a = list(range(1000, 1000 + 6 * BLOCK + 5))
    b = list(range(3000, 3000 + 5 * BLOCK))
    d.run(make_request("a", a, max_tokens=1))
    d.run(make_request("b", b, max_tokens=2), {1: {"b": 1}})
    d.run(make_request("c", list(range(7000, 7000 + 12 * BLOCK)), max_tokens=1))
    assert d.finished == {"a": "length", "b": "error" if guarded else "length", "c": "length"}
    if guarded:  # (a block may be copied again, once the CPU tier evicted its copy)
        assert all(h is not None and may_leave(state) for _, h, state in d.workers.stored)
    copied = {block_hash for _, block_hash, _ in d.workers.stored}
    return (
        [kvguard_hash(a, i) in copied for i in range(6)],
        [kvguard_hash(b, i) in copied for i in range(5)],
    )


@SCHEDULING
def test_lazy_mode_stores_a_clean_requests_blocks_as_stock_does(async_scheduling: bool) -> None:
    """Lazy mode copies the cached blocks nearest eviction. vLLM 0.34 frees each block it
    copied with ``evict_first``, and walks the free queue from its head every step: the
    copied blocks absorb the next allocations while the walk reaches the next ones. The
    guarded pool honours it, so kvguard stores what stock stores -- all 6 of a's blocks
    (its pool once put copied blocks back at the LRU end, and c's allocations evicted a
    block of a's never copied). Of b, stock copies the blocks the NaN step wrote, the
    guard only the two its clean first chunk validated."""
    stock_a, stock_b = lazy_scenario(False, async_scheduling)
    guarded_a, guarded_b = lazy_scenario(True, async_scheduling)
    if async_scheduling or vllm_series() >= (0, 34):
        assert stock_a == [True] * 6
    else:  # (0.33's walk resumes where it stopped: it passes a's first two blocks by)
        assert stock_a == [False, False, True, True, True, True]
    assert guarded_a == stock_a
    assert stock_b[2:4] == [True, True]  # the NaN step's blocks: stock stores them
    assert guarded_b == [True, True, False, False, False]


# ---------------------------------------------------------------------- stores


@SCHEDULING
@MODES
@pytest.mark.parametrize("multi", [False, True], ids=["alone", "multi"])
def test_clean_blocks_are_stored_once_validated_and_loaded_after_eviction(
    lazy: bool, async_scheduling: bool, multi: bool
) -> None:
    """A clean request's blocks reach the CPU tier once their steps validated (each
    once); after the GPU evicted them, a same-prompt request loads them from the CPU
    tier, and the loaded blocks are not matchable until a step of that request,
    computing on them, is counted clean."""
    s = simple_cpu_scheduler(
        lazy=lazy,
        async_scheduling=async_scheduling,
        num_blocks=8,
        # Lazy mode's walk reaches 2 * (max_num_batched_tokens / BLOCK) blocks past the
        # free queue's head: here the whole pool.
        max_num_batched_tokens=4 * BLOCK if lazy else BLOCK,
        multi=multi,
    )
    if multi:
        assert isinstance(connector_of(s), GuardedSimpleCPUOffloadConnector)
    core = s.kvguard_pool.core
    d = Driver(s, async_scheduling)
    d.run(make_request("a", PROMPT, max_tokens=2))
    assert d.finished["a"] == "length"
    if lazy:
        d.idle(2)  # a's cached blocks, near eviction in an idle pool, are stored
    # Another prompt takes every GPU block: a's cached blocks are evicted.
    d.run(make_request("b", list(range(5000, 5000 + 7 * BLOCK)), max_tokens=1))
    assert [core.cached_block_id(kvguard_hash(PROMPT, i)) for i in range(4)] == [None] * 4
    assert in_cpu_tier(s, PROMPT) == [True] * 4
    assert_stored_validated_only(d)
    stats = s.kvguard_stats()
    assert stats["offload_chunks_discarded"] == stats["dropped_acks"] == 0
    assert stats["stores_acknowledged"] == stats["offload_chunks_stored"] >= 4
    assert stats["offload_store_jobs"] >= 1
    assert core.tier_copies(kvguard_hash(PROMPT, 0)) == (TIER,)

    # A same-prompt request hits the CPU tier: 3 blocks load (the last token is
    # computed), then a step computes the rest on them.
    s.add_request(make_request("c", PROMPT, max_tokens=1))
    so = d.schedule()
    load = simple_cpu_metadata(so)
    assert len(load.load_gpu_blocks) == 3
    assert s.requests["c"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    loaded = list(load.load_gpu_blocks)
    for _ in range(3):
        d.process_due()
        so = d.schedule()
        if "c" in so.num_scheduled_tokens:
            break
    assert so.num_scheduled_tokens["c"] == BLOCK
    # Loaded, and computed on by a step in flight: not validated, not matchable.
    assert {core.block_state(b) for b in loaded} == {BlockState.WRITTEN}
    assert core.cached_block_id(kvguard_hash(PROMPT, 0)) is None
    d.process_due()
    d.drain()
    assert d.finished["c"] == "length"
    assert {core.block_state(b) for b in loaded} <= {BlockState.PUBLISHED, BlockState.OFFLOADED}
    assert core.cached_block_id(kvguard_hash(PROMPT, 0)) == loaded[0]


@SCHEDULING
def test_loaded_kv_of_a_failed_step_is_quarantined(async_scheduling: bool) -> None:
    """KV loaded from the CPU tier is vouched for by the step that computes on it:
    when that step has NaN logits, the loaded blocks are quarantined with the rest,
    never published (the CPU tier's copy, validated when stored, stays)."""
    s = simple_cpu_scheduler(async_scheduling=async_scheduling, max_num_batched_tokens=4 * BLOCK)
    core = s.kvguard_pool.core
    d = Driver(s, async_scheduling)
    d.run(make_request("a", PROMPT, max_tokens=1))
    assert in_cpu_tier(s, PROMPT) == [True] * 4
    assert s.reset_prefix_cache()  # the GPU's copies go
    s.add_request(make_request("c", PROMPT + [7] * 5, max_tokens=2))
    so = d.schedule()
    loaded = list(simple_cpu_metadata(so).load_gpu_blocks)
    assert len(loaded) == 4
    for _ in range(3):
        d.process_due()
        so = d.schedule()
        if "c" in so.num_scheduled_tokens:
            break
    d.process_due({"c": 1} if not async_scheduling else None)
    if async_scheduling:
        d.schedule()
        d.process_due({"c": 1})
    d.drain()
    assert d.finished["c"] == "error"
    assert {core.block_state(b) for b in loaded} == {BlockState.QUARANTINED}
    assert [core.cached_block_id(kvguard_hash(PROMPT, i)) for i in range(4)] == [None] * 4
    assert in_cpu_tier(s, PROMPT) == [True] * 4


@SCHEDULING
@MODES
def test_a_nan_requests_unvalidated_blocks_are_never_stored(
    lazy: bool, async_scheduling: bool
) -> None:
    """A request whose third block's step has NaN logits: its two validated blocks are
    stored, the blocks of the failed step never (not when it is aborted, not when its
    blocks sit quarantined at the front of the free queue); a request failing at its
    first step stores nothing."""
    s = simple_cpu_scheduler(
        lazy=lazy, async_scheduling=async_scheduling, num_blocks=8, max_num_batched_tokens=BLOCK
    )
    core = s.kvguard_pool.core
    d = Driver(s, async_scheduling)
    d.run(make_request("a", PROMPT, max_tokens=2), {2: {"a": 1}})
    d.run(make_request("b", list(range(3000, 3000 + 2 * BLOCK)), max_tokens=2), {0: {"b": 2}})
    assert d.finished == {"a": "error", "b": "error"}
    # Lazy mode stores cached blocks as they near eviction: let another prompt
    # through, past the quarantined blocks at the free queue's front.
    d.run(make_request("c", list(range(7000, 7000 + 5 * BLOCK)), max_tokens=1))
    assert in_cpu_tier(s, PROMPT) == [True, True, False, False]
    assert in_cpu_tier(s, list(range(3000, 3000 + 2 * BLOCK))) == [False, False]
    assert_stored_validated_only(d)
    assert core.tier_copies(kvguard_hash(PROMPT, 1)) == (TIER,)
    assert core.tier_copies(kvguard_hash(PROMPT, 2)) == ()
    assert s.kvguard_stats()["blocks_quarantined"] >= 2


# ---------------------------------------------------------------------- late completions


def _finish_with_store_in_flight(lazy: bool) -> tuple[Any, Driver, int, list[int]]:
    """Request "a" runs to its end; the store event copying its blocks is still in
    flight (held). Returns the scheduler, its driver, the event and its GPU blocks."""
    s = simple_cpu_scheduler(lazy=lazy, num_blocks=6, max_num_batched_tokens=4 * BLOCK)
    d = Driver(s)
    s.add_request(make_request("a", PROMPT[: 3 * BLOCK], max_tokens=1))
    for _ in range(6):
        so = s.schedule()
        meta = simple_cpu_metadata(so)
        if meta.store_event >= 0:
            d.workers.held.add(meta.store_event)
        d.workers.observe(so)
        s.update_from_output(so, d.workers.output(so))
        if meta.store_event >= 0 and len(meta.store_gpu_blocks) == 3:
            return s, d, meta.store_event, list(meta.store_gpu_blocks)
    raise AssertionError("no store event copied a's three blocks")


@MODES
def test_a_copy_finishing_after_its_block_was_quarantined_is_dropped(lazy: bool) -> None:
    """Block 1 of a's prefix is found corrupt while its copy runs (``invalidate``:
    it and its descendant are quarantined): when the workers report the copy done,
    those blocks are not registered in the CPU tier (never loadable); block 0 is."""
    s, d, event, copied = _finish_with_store_in_flight(lazy)
    core = s.kvguard_pool.core
    prompt = PROMPT[: 3 * BLOCK]
    report = core.invalidate([kvguard_hash(prompt, 1)])
    assert len(report.block_ids) == 2
    assert {core.block_state(b) for b in report.block_ids} == {BlockState.QUARANTINED}
    d.workers.release(event)
    d.step()
    assert event not in manager_of(s).kvguard_in_flight()
    assert in_cpu_tier(s, prompt) == [True, False, False]
    assert core.tier_copies(kvguard_hash(prompt, 0)) == (TIER,)
    assert core.tier_copies(kvguard_hash(prompt, 1)) == ()
    stats = s.kvguard_stats()
    assert stats["dropped_acks"] == stats["offload_chunks_discarded"] == 2
    assert stats["offload_chunks_stored"] == 1
    # The GPU blocks the copy held went back; the quarantined ones are reused first.
    assert all(s.kvguard_pool.blocks[b].ref_cnt == 0 for b in copied)
    assert s.kvguard_pool.get_num_free_blocks() == 5


@pytest.mark.usefixtures("log")
def test_a_block_quarantined_before_its_store_is_sent_is_taken_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A finishing request's last blocks are queued for storing (``request_finished``)
    and sent with the next step; one quarantined in between (``invalidate``) is taken
    out of the event before any worker sees it, with a WARNING."""
    s = simple_cpu_scheduler(max_num_batched_tokens=4 * BLOCK)
    core = s.kvguard_pool.core
    d = Driver(s)
    prompt = PROMPT[: 2 * BLOCK]
    s.add_request(make_request("a", prompt, max_tokens=1))
    d.step()  # a's whole prompt, and it finishes: both blocks queued for storing
    assert "a" not in s.requests
    core.invalidate([kvguard_hash(prompt, 1)], descendants=False)
    so = d.schedule()
    meta = simple_cpu_metadata(so)
    assert len(meta.store_gpu_blocks) == len(meta.store_cpu_blocks) == 1
    assert [core.block_state(b) for b in meta.store_gpu_blocks] == [BlockState.PUBLISHED]
    (line,) = [r.getMessage() for r in caplog.records if r.name == simple_cpu_module.logger.name]
    assert r"kvguard: store event 0 copies block(s) [" in line and "not stored" in line
    d.process_due()
    d.drain()
    assert in_cpu_tier(s, prompt) == [True, False]
    assert s.kvguard_stats()["offload_chunks_stored"] == 1
    assert s.kvguard_stats()["offload_store_jobs_cancelled"] == 0
    # The CPU block taken for it went back unhashed; the GPU pin is gone.
    cpu_pool = manager_of(s).cpu_block_pool
    assert cpu_pool.get_num_free_blocks() == cpu_pool.num_gpu_blocks - 1
    assert not s.kvguard_pool.retentions


def test_cache_reset_fails_the_tickets_in_flight() -> None:
    s, d, event, _ = _finish_with_store_in_flight(lazy=False)
    core = s.kvguard_pool.core
    assert manager_of(s).kvguard_in_flight()
    assert s.reset_prefix_cache(reset_connector=True) is False  # a copy still runs
    assert not manager_of(s).kvguard_in_flight()
    counters = core.stats().counters
    assert counters.stores_failed == 3 and counters.stores_acknowledged == 0
    d.workers.release(event)
    d.step()  # the abandoned copy's report: it only releases its blocks
    assert in_cpu_tier(s, PROMPT[: 3 * BLOCK]) == [False] * 3
    assert s.kvguard_stats()["dropped_acks"] == 0
    assert s.reset_prefix_cache(reset_connector=True)
    assert core.snapshot().tier_copies == ()


def test_kvguards_record_of_tier_copies_follows_the_cpu_tiers_evictions() -> None:
    """Many prompts through a CPU tier of 6 blocks: it evicts copies to make room, and
    kvguard forgets them -- ``tier_copies`` agrees with the tier block for block."""
    s = simple_cpu_scheduler(cpu_blocks=6, max_num_batched_tokens=2 * BLOCK)
    core = s.kvguard_pool.core
    d = Driver(s)
    prompts = [list(range(10_000 + 100 * i, 10_000 + 100 * i + 2 * BLOCK)) for i in range(12)]
    for i, prompt in enumerate(prompts):
        d.run(make_request(f"r{i}", prompt, max_tokens=1))
    held = 0
    for prompt in prompts:
        for index, present in enumerate(in_cpu_tier(s, prompt)):
            assert core.tier_copies(kvguard_hash(prompt, index)) == ((TIER,) if present else ())
            held += present
    stats = s.kvguard_stats()
    assert 0 < held <= 6
    assert stats["offload_chunks_evicted"] == stats["offload_chunks_stored"] - held > 0
    assert len(core.snapshot().tier_copies) == held
    assert s.reset_prefix_cache(reset_connector=True)
    assert core.snapshot().tier_copies == ()
    assert all(in_cpu_tier(s, prompt) == [False, False] for prompt in prompts)


# ---------------------------------------------------------------------- configuration


def test_without_kvguards_pool_it_is_vllms_connector() -> None:
    """The guard off: the guarded class is vLLM's connector (stores what vLLM stores)."""
    runs = {}
    for name, kwargs in {
        "stock": {"guarded": False},
        "off": {"kvguard": {"enabled": False}, "connector": GUARDED},
    }.items():
        s = simple_cpu_scheduler(**kwargs)  # type: ignore[arg-type]
        d = Driver(s)
        d.run(make_request("a", PROMPT, max_tokens=2), {1: {"a": 4}})
        runs[name] = (d.finished, in_cpu_tier(s, PROMPT))
        assert type(s) is Scheduler
    assert isinstance(connector_of(s), GuardedSimpleCPUOffloadConnector)
    assert manager_of(s).kvguard_pool() is None
    assert runs["off"] == runs["stock"] == ({"a": "length"}, [True] * 4)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("multi", [False, True], ids=["alone", "multi"])
def test_guarded_scheduler_refuses_the_stock_connector(lazy: bool, multi: bool) -> None:
    """vLLM's own connector under a guarded scheduler picked by hand (no plugin to
    substitute it) would copy unvalidated KV: the engine refuses to start, naming
    the gated class."""
    with pytest.raises(GuardConfigError, match="kv_connector='GuardedSimpleCPUOffloadConnector'"):
        simple_cpu_scheduler(connector=STOCK, lazy=lazy, multi=multi)


@pytest.mark.skipif(not names_tier_size(), reason="vLLM 0.32 sizes the CPU tier by bytes alone")
def test_naming_the_guarded_class_needs_the_tiers_size() -> None:
    """From vLLM 0.33 on, the engine sizes the scheduler's CPU tier from the workers
    only for ``kv_connector="SimpleCPUOffloadConnector"``: the guarded class named
    directly, without ``num_cpu_blocks``, refuses to start."""
    with pytest.raises(GuardConfigError, match="kv_connector='SimpleCPUOffloadConnector'"):
        simple_cpu_scheduler(tier_size=False)
    simple_cpu_scheduler(tier_size=True)  # num_cpu_blocks given: both sides agree


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``caplog`` gets what the guarded scheduler and the connector log."""
    with records_of([scheduler_module.logger, simple_cpu_module.logger], caplog, monkeypatch):
        yield


@pytest.fixture
def plugin_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    undo_plugin_patches_after(monkeypatch)
    monkeypatch.setenv("KVGUARD_GUARD", "1")
    plugin.register()
    plugin.register()
    yield


@pytest.mark.usefixtures("plugin_on", "log")
@pytest.mark.parametrize("multi", [False, True], ids=["alone", "multi"])
def test_plugin_substitutes_the_guarded_connector(
    multi: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The plugin gives ``GuardedSimpleCPUOffloadConnector`` for vLLM's name (inside a
    MultiConnector too); the start-up line names it among the gated connectors, and
    its counters reach ``kvguard_stats()``."""
    stock = KVTransferConfig(kv_connector=STOCK, kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(stock) is GuardedSimpleCPUOffloadConnector
    by_name = KVTransferConfig(kv_connector=GUARDED, kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(by_name) is GuardedSimpleCPUOffloadConnector
    s = simple_cpu_scheduler(connector=STOCK, multi=multi)
    connector = connector_of(s)
    assert type(connector) is GuardedSimpleCPUOffloadConnector
    assert isinstance(connector.scheduler_manager, GuardedSimpleCPUOffloadScheduler)
    (line,) = [r.getMessage() for r in caplog.records if "guard in force" in r.getMessage()]
    assert "connectors gated: GuardedSimpleCPUOffloadConnector;" in line
    assert "not gated" not in line
    d = Driver(s)
    d.run(make_request("a", PROMPT, max_tokens=2))
    stats = s.kvguard_stats()
    assert stats["offload_chunks_stored"] == 4
    assert stats["offload_store_jobs"] >= 1
