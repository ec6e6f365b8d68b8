"""KV found corrupt after the fact is purged from the CPU tiers kvguard gates: vLLM's
offloading connector's (its real scheduler side and CPU offloading manager) and
SimpleCPU offloading's (its real scheduler side and CPU block pool), alone and as a
``MultiConnector``'s child.

``scheduler.kvguard_invalidate(hashes)`` taints a published prefix that was offloaded;
the tier must stop serving it -- a request with that prefix loads none of it -- and
free its space, and kvguard's record of tier copies must forget it. A copy still being
loaded leaves every lookup at once and the tier when its load ends. Each connector's
run with its purger unregistered (``no_purgers``) shows what the purge prevents: the
core forgets the copies, the tier keeps serving them. A request whose load of a purged
copy is in flight is told its load failed (vLLM's load-failure policy then applies), so
what it loaded is never published (before the scheduler did so, these two tests failed).

The workers are played as in ``test_offloading`` and ``test_simple_cpu_offloading``.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (  # noqa: E402
    MultiConnector,
)
from vllm.v1.kv_offload.base import OffloadingEvent, ReqContext, make_offload_key  # noqa: E402

from kvguard import BlockHash  # noqa: E402
from kvguard.adapters.vllm.exits import offloading  # noqa: E402
from kvguard.adapters.vllm.exits import simple_cpu as simple_cpu_offloading  # noqa: E402
from kvguard.adapters.vllm.exits.tier_purge import TierPurgers  # noqa: E402

from .harness import BLOCK, hit_tokens, make_request, make_scheduler, transfer_config  # noqa: E402
from .harness import connector_output as output  # noqa: E402
from .test_offloading import HIT, MISS, store_blocks  # noqa: E402
from .test_simple_cpu_offloading import (  # noqa: E402
    Driver,
    in_cpu_tier,
    manager_of,
    simple_cpu_metadata,
    simple_cpu_scheduler,
)
from .test_simple_cpu_offloading import kvguard_hash as simple_cpu_hash  # noqa: E402

PROMPT = list(range(1000, 1000 + 4 * BLOCK))  # 4 full blocks
OTHER = list(range(5000, 5000 + 7 * BLOCK))
MULTI = pytest.mark.parametrize("multi", [False, True], ids=["alone", "multi"])
MODES = pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
OFFLOAD, SIMPLE_CPU = offloading.TIER, simple_cpu_offloading.TIER


@pytest.fixture
def no_purgers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The connectors built in the test register no purger: what kvguard did before
    tier copies were purged (the core reports them, nothing drops them)."""
    monkeypatch.setattr(TierPurgers, "add", lambda self, tier, purge: None)


def kvguard_keys(request: Any, indices: range) -> set[BlockHash]:
    """kvguard's keys (group 0) of the request's blocks at ``indices``."""
    return {BlockHash(request.block_hashes[i] + bytes(4)) for i in indices}


# ---------------------------------------------------------------------- OffloadingConnector


def offload_side(s: Any) -> Any:
    """The offloading connector's scheduler side (a MultiConnector's child's, if any)."""
    connector = s.connector
    if isinstance(connector, MultiConnector):
        (connector,) = connector.sub_connectors
    return connector.connector_scheduler


def cpu_tier(s: Any, prompt: list[int]) -> list[Any]:
    """What vLLM's CPU offloading manager answers for each full block of ``prompt``."""
    manager = offload_side(s).manager
    ctx = ReqContext(req_id="probe")
    return [
        manager.lookup(make_offload_key(h, 0), ctx)
        for h in make_request("probe", prompt).block_hashes
    ]


def offloaded(*, multi: bool = False) -> tuple[Any, Any]:
    """A scheduler whose request "a" ran ``PROMPT`` and whose 4 chunks are in the CPU
    tier (the workers finish each store at once); returns it and the request."""
    s = make_scheduler(kv_transfer_config=transfer_config(multi=multi))
    a = make_request("a", PROMPT, max_tokens=1)
    s.add_request(a)
    for _ in range(3):
        so = s.schedule()
        s.update_from_output(so, output(s, so, completed=store_blocks(so)))
    assert not s.requests
    assert cpu_tier(s, PROMPT) == [HIT] * 4
    return s, a


def load_jobs(so: Any) -> dict[int, Any]:
    meta = so.kv_connector_metadata
    if hasattr(meta, "metadata"):  # a MultiConnector's
        (meta,) = meta.metadata
    return dict(meta.load_jobs)


@MULTI
def test_invalidating_an_offloaded_prefix_purges_its_cpu_chunks(multi: bool) -> None:
    """Block 2 of a published, offloaded prefix is found corrupt: it and its descendant
    (block 3) leave the GPU prefix cache and the CPU tier -- their chunks are free
    again, a removal event says so, kvguard records no copy -- and blocks 0 and 1 stay
    in both. A request with the prompt hits the GPU's two and loads nothing."""
    s, a = offloaded(multi=multi)
    side = offload_side(s)
    manager = side.manager
    core = s.kvguard_pool.core
    manager.events = []  # (vLLM keeps them only with KV events on)
    free = manager._get_num_free_chunks()

    report = s.kvguard_invalidate(a.block_hashes[2:3])

    tainted = kvguard_keys(a, range(2, 4))
    assert set(report.invalidation.hashes) == tainted
    assert set(report.purged) == {OFFLOAD}
    assert set(report.purged[OFFLOAD]) == tainted
    assert report.unpurged == ()
    assert cpu_tier(s, PROMPT) == [HIT, HIT, MISS, MISS]
    assert manager._get_num_free_chunks() == free + 2
    (event,) = manager.take_events()
    assert isinstance(event, OffloadingEvent) and event.removed
    assert set(event.keys) == {make_offload_key(a.block_hashes[i], 0) for i in (2, 3)}
    assert [core.tier_copies(h) for h in sorted(tainted)] == [(), ()]
    assert core.tier_copies(next(iter(kvguard_keys(a, range(1))))) == (OFFLOAD,)
    assert len(side.kvguard_gate.recorded()) == 2
    stats = s.kvguard_stats()
    assert stats["tier_copies_purged"] == stats["offload_chunks_purged"] == 2

    s.add_request(make_request("again", PROMPT, max_tokens=1))
    so = s.schedule()
    assert hit_tokens(so) == {"again": 2 * BLOCK}  # the GPU's clean blocks
    assert load_jobs(so) == {}  # nothing from the CPU tier
    s.update_from_output(so, output(s, so))
    s.kvguard_pool.check_consistency()


@pytest.mark.parametrize("descendants", [True, False])
def test_a_purged_tier_prefix_is_loaded_by_no_request(descendants: bool) -> None:
    """The GPU's copies are gone (a prefix-cache reset), only the CPU tier holds the
    prefix: invalidating its first block purges it and, with ``descendants``, the
    chunks chained after it (kvguard knows them from its record of tier copies). Either
    way a request with the prompt loads none of it."""
    s, a = offloaded()
    core = s.kvguard_pool.core
    assert s.reset_prefix_cache()
    manager = offload_side(s).manager
    free = manager._get_num_free_chunks()

    report = s.kvguard_invalidate(a.block_hashes[:1], descendants=descendants)

    gone = 4 if descendants else 1
    assert set(report.purged[OFFLOAD]) == kvguard_keys(a, range(gone))
    assert cpu_tier(s, PROMPT) == [MISS] * gone + [HIT] * (4 - gone)
    assert manager._get_num_free_chunks() == free + gone
    assert len(core.snapshot().tier_copies) == 4 - gone
    s.add_request(make_request("again", PROMPT, max_tokens=1))
    so = s.schedule()
    assert hit_tokens(so) == {"again": 0}
    assert load_jobs(so) == {}
    s.update_from_output(so, output(s, so))
    s.kvguard_pool.check_consistency()


@pytest.mark.usefixtures("no_purgers")
def test_without_its_purger_the_cpu_tier_serves_invalidated_kv() -> None:
    """The check that the purge matters: unregistered, the invalidation reports the
    copies unpurged, kvguard forgets them -- and vLLM's CPU tier still serves them; a
    request with the prompt loads the corrupt chunks."""
    s, a = offloaded()
    core = s.kvguard_pool.core
    assert s.reset_prefix_cache()

    report = s.kvguard_invalidate(a.block_hashes[:1])

    assert report.purged == {}
    assert {h for _, h in report.unpurged} == kvguard_keys(a, range(4))
    assert core.snapshot().tier_copies == ()
    assert cpu_tier(s, PROMPT) == [HIT] * 4
    s.add_request(make_request("again", PROMPT, max_tokens=1))
    (load,) = load_jobs(s.schedule()).values()
    assert len(load.src_spec.block_ids) >= 3  # the corrupt chunks


def test_a_chunk_being_loaded_leaves_lookups_now_and_the_tier_when_loaded() -> None:
    """A request is loading the prefix when block 3 is found corrupt: the workers are
    reading its chunk, so the chunk stays allocated, pinned, but no lookup finds it; it
    leaves the tier, its space free, when the load completes."""
    s, a = offloaded()
    assert s.reset_prefix_cache()
    manager = offload_side(s).manager
    free = manager._get_num_free_chunks()
    s.add_request(make_request("b", PROMPT + [7] * 5, max_tokens=1))
    so = s.schedule()
    ((load_id, load),) = load_jobs(so).items()
    assert len(load.src_spec.block_ids) == 4
    s.update_from_output(so, output(s, so))  # the load runs

    report = s.kvguard_invalidate(a.block_hashes[3:4])

    key = make_offload_key(a.block_hashes[3], 0)
    assert set(report.purged[OFFLOAD]) == kvguard_keys(a, range(3, 4))
    assert cpu_tier(s, PROMPT) == [HIT, HIT, HIT, MISS]
    assert manager._policy.get(key).ref_cnt == 1  # still being read
    assert manager._get_num_free_chunks() == free
    so = s.schedule()
    s.update_from_output(so, output(s, so, completed=[load_id], recved=["b"]))
    assert manager._policy.get(key) is None
    assert manager._get_num_free_chunks() == free + 1
    assert not offload_side(s)._kvguard_purging
    for _ in range(4):
        so = s.schedule()
        s.update_from_output(so, output(s, so, completed=store_blocks(so)))
    assert not s.requests
    assert cpu_tier(s, PROMPT)[:3] == [HIT] * 3
    s.kvguard_pool.check_consistency()


def test_a_connector_reset_forgets_the_chunks_waiting_for_their_loads() -> None:
    """A connector reset empties the tier, the purged chunk being loaded with it:
    nothing is left waiting for a load's end (that load's report is stale then)."""
    s, a = offloaded()
    assert s.reset_prefix_cache()
    side = offload_side(s)
    s.add_request(make_request("b", PROMPT + [7] * 5, max_tokens=1))
    so = s.schedule()
    (load_id,) = load_jobs(so)
    s.update_from_output(so, output(s, so))  # the load runs
    s.kvguard_invalidate(a.block_hashes[3:4])
    assert side._kvguard_purging
    s.reset_connector_cache()
    assert not side._kvguard_purging
    assert cpu_tier(s, PROMPT) == [MISS] * 4
    so = s.schedule()
    s.update_from_output(so, output(s, so, completed=[load_id], recved=["b"]))
    assert cpu_tier(s, PROMPT) == [MISS] * 4
    assert not side._kvguard_purging


# ---------------------------------------------------------------------- SimpleCPU


def simple_cpu_stored(*, lazy: bool = False, multi: bool = False) -> tuple[Any, Driver, Any]:
    """A scheduler whose request "a" ran ``PROMPT``, its 4 blocks in the SimpleCPU tier
    and no longer on the GPU (another prompt took every GPU block)."""
    s = simple_cpu_scheduler(
        lazy=lazy,
        num_blocks=8,
        # Lazy mode walks 2 * (max_num_batched_tokens / BLOCK) blocks past the free
        # queue's head: here the whole pool.
        max_num_batched_tokens=4 * BLOCK if lazy else BLOCK,
        multi=multi,
    )
    d = Driver(s)
    a = make_request("a", PROMPT, max_tokens=2)
    d.run(a)
    if lazy:
        d.idle(2)  # a's cached blocks, near eviction in an idle pool, are stored
    d.run(make_request("b", OTHER, max_tokens=1))
    assert in_cpu_tier(s, PROMPT) == [True] * 4
    return s, d, a


def loads_of(s: Any, d: Driver, prompt: list[int]) -> int:
    """How many blocks a request with ``prompt`` loads from the SimpleCPU tier."""
    s.add_request(make_request("again", prompt, max_tokens=1))
    so = d.schedule()
    loaded = len(simple_cpu_metadata(so).load_gpu_blocks)
    d.flush()
    d.drain()
    return loaded


@MODES
@MULTI
def test_invalidating_a_stored_prefix_purges_its_simple_cpu_blocks(lazy: bool, multi: bool) -> None:
    """Block 2 of a prefix the SimpleCPU tier holds is found corrupt: it and its
    descendant leave the CPU pool's prefix cache (their CPU blocks unhashed, free),
    kvguard records no copy; a request with the prompt loads blocks 0 and 1 only."""
    s, d, a = simple_cpu_stored(lazy=lazy, multi=multi)
    manager = manager_of(s)
    cpu_pool = manager.cpu_block_pool
    core = s.kvguard_pool.core
    purged_blocks = [
        cpu_pool.cached_block_hash_to_block.get_one_block(simple_cpu_hash(PROMPT, i))
        for i in (2, 3)
    ]
    cached = len(cpu_pool.cached_block_hash_to_block)
    free = cpu_pool.get_num_free_blocks()

    report = s.kvguard_invalidate(a.block_hashes[2:3])

    tainted = kvguard_keys(a, range(2, 4))
    assert set(report.invalidation.hashes) == tainted
    assert set(report.purged) == {SIMPLE_CPU}
    assert set(report.purged[SIMPLE_CPU]) == tainted
    assert report.unpurged == ()
    assert in_cpu_tier(s, PROMPT) == [True, True, False, False]
    assert len(cpu_pool.cached_block_hash_to_block) == cached - 2
    assert all(b.block_hash is None and b.ref_cnt == 0 for b in purged_blocks)
    assert cpu_pool.get_num_free_blocks() == free
    assert [core.tier_copies(h) for h in sorted(tainted)] == [(), ()]
    assert core.tier_copies(simple_cpu_hash(PROMPT, 0)) == (SIMPLE_CPU,)
    assert not tainted & set(manager.kvguard_gate.held_keys())
    stats = s.kvguard_stats()
    assert stats["tier_copies_purged"] == stats["offload_chunks_purged"] == 2
    assert stats["offload_chunks_evicted"] == 0  # (a purge is not an eviction)

    assert loads_of(s, d, PROMPT) == 2
    s.kvguard_pool.check_consistency()


@pytest.mark.usefixtures("no_purgers")
def test_without_its_purger_the_simple_cpu_tier_serves_invalidated_kv() -> None:
    s, d, a = simple_cpu_stored()
    core = s.kvguard_pool.core

    report = s.kvguard_invalidate(a.block_hashes[:1])

    assert report.purged == {}
    assert {h for _, h in report.unpurged} == kvguard_keys(a, range(4))
    assert [core.tier_copies(simple_cpu_hash(PROMPT, i)) for i in range(4)] == [()] * 4
    assert in_cpu_tier(s, PROMPT) == [True] * 4
    assert loads_of(s, d, PROMPT) == 3  # the corrupt blocks (the last token is computed)


def test_a_simple_cpu_purge_with_descendants_leaves_nothing_to_load() -> None:
    s, d, a = simple_cpu_stored()
    core = s.kvguard_pool.core
    report = s.kvguard_invalidate(a.block_hashes[:1])
    assert set(report.purged[SIMPLE_CPU]) == kvguard_keys(a, range(4))
    assert in_cpu_tier(s, PROMPT) == [False] * 4
    assert [core.tier_copies(simple_cpu_hash(PROMPT, i)) for i in range(4)] == [()] * 4
    assert not kvguard_keys(a, range(4)) & set(manager_of(s).kvguard_gate.held_keys())
    assert loads_of(s, d, PROMPT) == 0


def test_a_simple_cpu_block_being_loaded_leaves_the_cache_now_and_the_pool_when_loaded() -> None:
    """A request is loading the prefix when block 3 is found corrupt: its CPU block
    loses its hash at once (no lookup finds it) but stays pinned while the workers read
    it; the load's end frees it, unhashed."""
    s, d, a = simple_cpu_stored()
    cpu_pool = manager_of(s).cpu_block_pool
    free = cpu_pool.get_num_free_blocks()
    block = cpu_pool.cached_block_hash_to_block.get_one_block(simple_cpu_hash(PROMPT, 3))
    s.add_request(make_request("c", PROMPT + [7] * 5, max_tokens=1))
    so = d.schedule()
    assert block.block_id in simple_cpu_metadata(so).load_cpu_blocks
    assert block.ref_cnt == 1

    report = s.kvguard_invalidate(a.block_hashes[3:4])

    assert set(report.purged[SIMPLE_CPU]) == kvguard_keys(a, range(3, 4))
    assert in_cpu_tier(s, PROMPT) == [True, True, True, False]
    assert block.block_hash is None and block.ref_cnt == 1
    d.process_due()  # the workers report the load done
    assert block.ref_cnt == 0 and block.block_hash is None
    assert cpu_pool.get_num_free_blocks() == free
    d.drain()
    s.kvguard_pool.check_consistency()


# ---------------------------------------------------------------------- known gap


def test_a_request_loading_a_purged_chunk_does_not_publish_it() -> None:
    s, a = offloaded()
    assert s.reset_prefix_cache()
    s.add_request(make_request("b", PROMPT + [7] * 5, max_tokens=2))
    so = s.schedule()
    (load_id,) = load_jobs(so)
    s.update_from_output(so, output(s, so))  # the load runs
    s.kvguard_invalidate(a.block_hashes[3:4])
    so = s.schedule()
    s.update_from_output(so, output(s, so, completed=[load_id], recved=["b"]))
    for _ in range(4):
        so = s.schedule()
        s.update_from_output(so, output(s, so, completed=store_blocks(so)))
    (corrupt,) = kvguard_keys(a, range(3, 4))
    assert s.kvguard_pool.core.cached_block_id(corrupt) is None


def test_a_request_loading_a_purged_simple_cpu_block_does_not_publish_it() -> None:
    s, d, a = simple_cpu_stored()
    s.add_request(make_request("c", PROMPT + [7] * 5, max_tokens=2))
    d.schedule()  # the load is sent
    s.kvguard_invalidate(a.block_hashes[3:4])
    d.process_due()
    d.drain()
    (corrupt,) = kvguard_keys(a, range(3, 4))
    assert s.kvguard_pool.core.cached_block_id(corrupt) is None
    assert not in_cpu_tier(s, PROMPT)[3]
