"""``GuardedSimpleCPUOffloadConnector``: vLLM's SimpleCPU offloading behind kvguard's tier gate.

vLLM's SimpleCPU offloading decides every copy on the scheduler side
(``SimpleCPUOffloadScheduler.build_connector_meta``, once per step); its workers only
carry out the block lists they are sent and report each store event done. It picks:

* **eager mode**: each request's blocks up to ``num_computed_tokens -
  num_output_placeholders`` ("confirmed" tokens: under async scheduling a prefill chunk
  in flight counts), per step and once more when the request finishes
  (``request_finished_all_groups``), whatever became of the steps that wrote them;
* **lazy mode**: any freed block near the head of the GPU pool's free list that still
  has a hash;
* boundary states the KV cache manager hands off (Mamba).

This subclass changes the scheduler side only; workers run vLLM's code unchanged.

* **Stores copy validated blocks only.** In eager mode each request's blocks are cut,
  for vLLM's selection, at the first block past its store cursor that kvguard does not
  hold as VALIDATED/PUBLISHED/OFFLOADED *with this request's hash at that position*:
  vLLM's cursor waits there, so a block is offered at the first step after the step
  that filled it validated (vLLM's own selection, finding it unhashed on kvguard's
  pool, would pass over it for good), and a block a failed or never-validated step
  wrote is never offered, not even when its request finishes. Lazy mode walks kvguard's free queue
  (:class:`~kvguard.adapters.vllm.pool.block_pool.KvGuardFreeQueue`), where only published
  blocks carry a hash.
* **One ``StoreTicket`` per copied block** (``BlockPool.begin_store``) when a store
  event is built, whatever chose the block; a block kvguard refuses (quarantined or
  invalidated since it was picked) is taken out of the event before any worker sees it.
* **Completions go through ``ack_store``.** When every worker reported a store event
  done, each block's ticket is acknowledged; a block whose ticket the core rejects
  (quarantined, invalidated or reused since the copy began) is not registered in the
  CPU tier's prefix cache: its CPU block goes back unhashed, so the copy never becomes
  loadable.
* A cache reset fails the tickets of the events it abandons.
* **kvguard's record of tier copies follows the tier**: a copy the CPU pool evicts, or
  drops in a reset, is withdrawn (``forget_tier_copy``).
* **Invalidated copies are purged** (:mod:`kvguard.adapters.vllm.exits.tier_purge`): bound to
  kvguard's pool, the connector registers a purger for its tier, which drops each
  invalidated hash's CPU block from the CPU pool's prefix cache (``evict_blocks``: a
  removal event goes out), so it never hits again. A CPU block being loaded (pinned by
  its load) loses its hash at once too; it returns to the CPU pool's free list,
  unhashed, when the load releases it.

KV loaded back from the CPU tier is what any connector loads: the blocks vLLM
allocated for it are WRITTEN until a step of the request, computing on them, is counted
clean (the guarded scheduler's rule, :mod:`kvguard.adapters.vllm.scheduler.guarded`). vLLM pins
them (``touch``) while the load runs; kvguard's pool counts such a pin on a block
being written apart (:meth:`~kvguard.adapters.vllm.pool.block_pool.GuardedBlockPool.touch`).

Without kvguard's pool underneath (stock scheduler, or the guard off: vLLM's own
scheduler and pool) it is vLLM's ``SimpleCPUOffloadConnector``. The plugin
(``KVGUARD_GUARD=1``) substitutes it for ``kv_connector="SimpleCPUOffloadConnector"``,
also inside a ``MultiConnector``; keep that name: from vLLM 0.33 on, the engine sizes
the CPU tier from its workers only for a connector configured under it (naming this
class directly needs an explicit ``num_cpu_blocks``, or the scheduler refuses to start).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvguard.adapters.vllm._compat import (
    require_supported_vllm,
    simple_cpu_tier_sized_by_name,
)

require_supported_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (  # noqa: E402
    SimpleCPUOffloadConnector,
)
from vllm.logger import init_logger  # noqa: E402
from vllm.v1.core.kv_cache_utils import resolve_block_hashes  # noqa: E402
from vllm.v1.simple_kv_offload.manager import (  # noqa: E402
    SimpleCPUOffloadScheduler,
    TransferMeta,
)
from vllm.v1.simple_kv_offload.metadata import INVALID_JOB_ID  # noqa: E402

from kvguard.adapters.vllm.config import GuardConfigError  # noqa: E402
from kvguard.adapters.vllm.metrics import CONNECTOR_HELP  # noqa: E402
from kvguard.adapters.vllm.pool.block_pool import GuardedBlockPool, group_suffix  # noqa: E402
from kvguard.errors import NotStorableError  # noqa: E402
from kvguard.hashing import BlockHash  # noqa: E402
from kvguard.results import StoreTicket  # noqa: E402
from kvguard.states import STORABLE_STATES  # noqa: E402

logger = init_logger(f"vllm.{__name__}")
"""Under vLLM's logger, as the scheduler's: vLLM's handler, format and level apply."""

TIER = "vllm-simple-cpu"
"""The tier name kvguard records the connector's copies under (``tier_copies``)."""

STOCK_NAME = "SimpleCPUOffloadConnector"
"""vLLM's name for the connector, which its engine core looks for."""


class GuardedSimpleCPUOffloadScheduler(SimpleCPUOffloadScheduler):
    """The scheduler side of :class:`GuardedSimpleCPUOffloadConnector`.

    vLLM's connector builds a ``SimpleCPUOffloadScheduler`` from settings it parses
    itself (differently in each series); :meth:`kvguard_adopt` makes that object this
    subclass, which only adds kvguard's state and the overrides below.

    Counters (``kvguard_counters``, the names of the offloading connector's, a block
    being this tier's chunk): ``offload_store_jobs`` store events sent to the workers
    after the gate; ``offload_store_jobs_cancelled`` events kvguard emptied (every
    block refused); ``offload_chunks_stored`` blocks registered in the CPU tier with
    their ticket acknowledged; ``offload_chunks_discarded`` blocks whose copy finished
    too late (not registered); ``offload_chunks_evicted`` recorded copies the CPU tier
    evicted to make room; ``offload_chunks_purged`` CPU blocks dropped because their
    hash was invalidated; ``offload_store_jobs_failed`` stays 0 (SimpleCPU's workers
    report no failed stores).
    """

    _kvguard_tickets: dict[int, list[StoreTicket]]
    _kvguard_stored: set[BlockHash]
    kvguard_counters: dict[str, int]

    def kvguard_adopt(self) -> None:
        """Set up kvguard's state on a manager vLLM built (see the class doc)."""
        # Store event -> the tickets of the GPU blocks it copies, index-parallel with
        # its TransferMeta.gpu_block_ids.
        self._kvguard_tickets = {}
        # Hashes kvguard records a copy of in this tier: what to withdraw when the CPU
        # pool evicts them (the record stays the tier's size).
        self._kvguard_stored = set()
        self.kvguard_counters = dict.fromkeys(CONNECTOR_HELP, 0)
        self._kvguard_observe_cpu_pool()

    def kvguard_pool(self) -> GuardedBlockPool | None:
        """kvguard's pool under the scheduler, or None (vLLM's own pool: stock vLLM or
        the guard off; the connector is then vLLM's own). The guarded scheduler binds
        the connector to kvguard's pool after it replaced vLLM's."""
        pool = self._gpu_block_pool
        return pool if isinstance(pool, GuardedBlockPool) else None

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        super().bind_gpu_block_pool(gpu_block_pool)
        if isinstance(gpu_block_pool, GuardedBlockPool):
            gpu_block_pool.tier_purgers.add(TIER, self._kvguard_purge)

    # ------------------------------------------------------------------ store selection

    def _select_eager_blocks_to_store(
        self, state: Any, block_ids_by_group: tuple[list[int], ...]
    ) -> Any:
        pool = self.kvguard_pool()
        if pool is not None:
            block_ids_by_group = self._kvguard_validated_prefix(pool, state, block_ids_by_group)
        return super()._select_eager_blocks_to_store(state, block_ids_by_group)

    def _kvguard_validated_prefix(
        self, pool: GuardedBlockPool, state: Any, block_ids_by_group: tuple[list[int], ...]
    ) -> tuple[list[int], ...]:
        """Each group's block ids, cut at the first block past the request's store
        cursor that kvguard does not hold as VALIDATED or later carrying this request's
        hash for its position (unvalidated, quarantined, or reused for other tokens).
        vLLM selects from the cut lists, so its cursor stops there instead of passing
        over the block. Null blocks (outside a window) are left to vLLM, which stores
        the cached block of that position, if any: kvguard's index holds published
        blocks only."""
        records = pool.blocks
        request_hashes = state.request.block_hashes
        hash_block_size = self.hash_block_size
        out: list[list[int]] = []
        for group_id, block_ids in enumerate(block_ids_by_group):
            if group_id not in self.prefix_cacheable_group_ids:
                out.append(block_ids)
                continue
            block_size = self.group_block_sizes[group_id]
            hashes = (
                request_hashes
                if block_size == hash_block_size
                else resolve_block_hashes(request_hashes, hash_block_size, block_size)
            )
            suffix = group_suffix(group_id)
            end = min(len(block_ids), len(hashes))
            n = min(state.num_stored_blocks[group_id], end)
            while n < end:
                block = records[block_ids[n]]
                if not block.is_null and (
                    block.state not in STORABLE_STATES or block.block_hash != hashes[n] + suffix
                ):
                    break
                n += 1
            out.append(block_ids[:n])
        return tuple(out)

    # ------------------------------------------------------------------ store admission

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        pool = self.kvguard_pool()
        if pool is not None and meta.store_event != INVALID_JOB_ID:
            self._kvguard_admit(pool, meta)
        return meta

    def _kvguard_admit(self, pool: GuardedBlockPool, meta: Any) -> None:
        """A ticket per GPU block of the step's store event; blocks kvguard refuses
        leave the event before it reaches a worker (an event left empty is dropped)."""
        event = meta.store_event
        transfer = self._store_event_to_blocks[event]
        begin_store = pool.core.begin_store
        tickets: list[StoreTicket] = []
        refused: list[int] = []
        for index, block_id in enumerate(transfer.gpu_block_ids):
            try:
                tickets.append(begin_store(block_id, TIER))
            except NotStorableError:
                refused.append(index)
        if refused:
            logger.warning(
                "kvguard: store event %d copies block(s) %s, which are not validated "
                "(quarantined or invalidated since they were picked); they are not stored",
                event,
                [transfer.gpu_block_ids[i] for i in refused],
            )
            self._kvguard_take_out(transfer, refused)
            # (The worker reads the event's lists from the metadata.)
            meta.store_gpu_blocks = transfer.gpu_block_ids
            meta.store_cpu_blocks = transfer.cpu_block_ids
        if transfer.gpu_block_ids:
            self._kvguard_tickets[event] = tickets
            self.kvguard_counters["offload_store_jobs"] += 1
            return
        self._kvguard_drop_event(event)
        meta.store_event = INVALID_JOB_ID
        self.kvguard_counters["offload_store_jobs_cancelled"] += 1

    def _kvguard_take_out(self, transfer: Any, indices: Iterable[int]) -> None:
        """Remove the blocks at ``indices`` from a store event (in place) and give back
        what vLLM took for them: the CPU block (unhashed, so it never hits) and the
        reference on the GPU block."""
        gone = set(indices)
        keep = [i for i in range(len(transfer.gpu_block_ids)) if i not in gone]
        dropped = TransferMeta(
            [transfer.gpu_block_ids[i] for i in sorted(gone)],
            [transfer.cpu_block_ids[i] for i in sorted(gone)],
        )
        transfer.gpu_block_ids[:] = [transfer.gpu_block_ids[i] for i in keep]
        transfer.cpu_block_ids[:] = [transfer.cpu_block_ids[i] for i in keep]
        if transfer.block_meta is not None:
            transfer.block_meta[:] = [transfer.block_meta[i] for i in keep]
        if not self._lazy_mode:
            # (Eager mode keeps the GPU blocks of the events in flight, so as not to
            # copy a block twice; a block also listed among those kept stays.)
            self._in_flight_store_gpu_blocks.difference_update(
                set(dropped.gpu_block_ids).difference(transfer.gpu_block_ids)
            )
        self._release_transfer_refs(dropped)

    def _kvguard_drop_event(self, event: int) -> None:
        """Forget a store event vLLM just built and kvguard emptied."""
        del self._store_event_to_blocks[event]
        for req_id in self._store_event_to_reqs.pop(event, ()):
            state = self._reqs_to_store.get(req_id)
            if state is None:
                continue
            state.store_events.discard(event)
            if state.finished and not state.store_events:
                self._cleanup_store_request(req_id)

    # ------------------------------------------------------------------ acknowledgements

    def _process_store_event(self, event_idx: int) -> None:
        # Every worker finished the event: before vLLM registers its copies in the CPU
        # tier, each block's ticket is acknowledged.
        tickets = self._kvguard_tickets.pop(event_idx, None)
        transfer = self._store_event_to_blocks.get(event_idx)
        pool = self.kvguard_pool()
        if tickets is not None and transfer is not None and pool is not None:
            self._kvguard_acknowledge(pool, transfer, tickets)
        super()._process_store_event(event_idx)

    def _kvguard_acknowledge(
        self, pool: GuardedBlockPool, transfer: Any, tickets: list[StoreTicket]
    ) -> None:
        """Acknowledge each copied block's ticket; a block whose ticket the core rejects
        leaves the event, so vLLM does not register its copy."""
        ack = pool.core.ack_store
        stored = self._kvguard_stored
        late: list[int] = []
        for index, ticket in enumerate(tickets):
            if ack(ticket):
                stored.add(ticket.block_hash)
            else:
                late.append(index)
        counters = self.kvguard_counters
        counters["offload_chunks_stored"] += len(tickets) - len(late)
        if late:
            counters["offload_chunks_discarded"] += len(late)
            self._kvguard_take_out(transfer, late)

    # ------------------------------------------------------------------ cache reset

    def reset(self) -> bool:
        # vLLM abandons the store events in flight (their completions only release the
        # blocks): their tickets fail.
        pool = self.kvguard_pool()
        if pool is not None:
            for tickets in self._kvguard_tickets.values():
                for ticket in tickets:
                    pool.core.fail_store(ticket)
        self._kvguard_tickets.clear()
        return bool(super().reset())

    # ------------------------------------------------------------------ the CPU tier

    def _kvguard_observe_cpu_pool(self) -> None:
        """The CPU tier is a vLLM ``BlockPool`` of its own. Every copy it drops leaves
        through ``_remove_cached_block_hashes`` (eviction to make room, ``evict_blocks``)
        or ``reset_prefix_cache``; both are observed, so that kvguard's record of tier
        copies names only what the tier holds."""
        cpu_pool = self.cpu_block_pool
        remove_hashes = cpu_pool._remove_cached_block_hashes
        reset_prefix_cache = cpu_pool.reset_prefix_cache

        def observed_remove(block: Any) -> Any:
            removed = remove_hashes(block)
            if removed and self._kvguard_stored:
                lookup = cpu_pool.cached_block_hash_to_block.get_one_block
                gone = self._kvguard_forget([h for h in removed if lookup(h) is None])
                self.kvguard_counters["offload_chunks_evicted"] += gone
            return removed

        def observed_reset() -> Any:
            done = reset_prefix_cache()
            if done:
                self._kvguard_forget(list(self._kvguard_stored))
            return done

        cpu_pool._remove_cached_block_hashes = observed_remove
        cpu_pool.reset_prefix_cache = observed_reset

    def _kvguard_forget(self, hashes: Iterable[Any]) -> int:
        """The CPU tier no longer holds these hashes: withdraw kvguard's record of
        them. Returns how many it recorded."""
        stored = self._kvguard_stored
        pool = self.kvguard_pool()
        forgotten = 0
        for block_hash in hashes:
            if block_hash not in stored:
                continue
            stored.discard(block_hash)
            forgotten += 1
            if pool is not None:
                pool.core.forget_tier_copy(TIER, block_hash)
        return forgotten

    def _kvguard_purge(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """The tier's purger (:mod:`kvguard.adapters.vllm.exits.tier_purge`): drop the CPU
        blocks holding ``hashes`` (kvguard's keys, the CPU pool's too) from the CPU
        pool's prefix cache; returns the hashes whose copy was dropped. A block a load
        is reading keeps its bytes until the load releases it, unhashed: no lookup
        finds it meanwhile, and its space is free after."""
        stored = self._kvguard_stored
        cpu_pool = self.cpu_block_pool
        lookup = cpu_pool.cached_block_hash_to_block.get_one_block
        purged: list[BlockHash] = []
        evicted = 0
        for block_hash in hashes:
            if block_hash not in stored:
                continue
            # (The core dropped its record itself, when it invalidated the hash.)
            stored.discard(block_hash)
            # The tier may hold several copies of a hash (a duplicate stored while the
            # first copy was in flight): every one goes.
            copies = 0
            for _ in range(cpu_pool.num_gpu_blocks):
                block = lookup(block_hash)
                if block is None:
                    break
                cpu_pool.evict_blocks({block.block_id})
                copies += 1
            if copies:
                purged.append(block_hash)
                evicted += copies
        self.kvguard_counters["offload_chunks_purged"] += evicted
        return purged

    def kvguard_in_flight(self) -> dict[int, tuple[int, ...]]:
        """Store event -> the GPU blocks of the events whose acknowledgement is due."""
        return {event: tuple(t.block_id for t in ts) for event, ts in self._kvguard_tickets.items()}


class GuardedSimpleCPUOffloadConnector(SimpleCPUOffloadConnector):
    """vLLM's ``SimpleCPUOffloadConnector`` whose stores pass kvguard's tier gate."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        manager = self.scheduler_manager
        if manager is None:
            return  # a worker, or prefix caching off (vLLM then offloads nothing)
        refuse_unsized_tier(vllm_config)
        manager.__class__ = GuardedSimpleCPUOffloadScheduler
        manager.kvguard_adopt()

    def kvguard_stats(self) -> dict[str, int]:
        manager = self.scheduler_manager
        if not isinstance(manager, GuardedSimpleCPUOffloadScheduler):
            return {}
        return dict(manager.kvguard_counters)


def refuse_unsized_tier(vllm_config: Any) -> None:
    """From vLLM 0.33 on, the engine core asks the workers how many CPU blocks they
    allocated, and hands the count to the scheduler side, only for a connector
    configured as ``SimpleCPUOffloadConnector``; under another name the scheduler
    would size the tier from the byte budget alone, which may disagree with the
    workers' tier -- unless ``num_cpu_blocks`` fixes it for both."""
    if not simple_cpu_tier_sized_by_name():
        return
    kv_transfer_config = vllm_config.kv_transfer_config
    if kv_transfer_config.has_connector(STOCK_NAME):
        return
    if vllm_config.cache_config.simple_cpu_offload_num_blocks is not None:
        return
    if "num_cpu_blocks" in _simple_cpu_extra_config(kv_transfer_config):
        return
    raise GuardConfigError(
        "GuardedSimpleCPUOffloadConnector named in --kv-transfer-config: vLLM's engine "
        f"sizes the CPU tier from its workers only for kv_connector={STOCK_NAME!r}, so "
        "the scheduler's and the workers' CPU tiers could differ. Configure "
        f"kv_connector={STOCK_NAME!r} and start vLLM with kvguard's plugin "
        "(KVGUARD_GUARD=1, or --additional-config '{\"kvguard\": {}}'), which puts the "
        "guarded connector in its place; or set num_cpu_blocks in "
        "kv_connector_extra_config."
    )


def _simple_cpu_extra_config(kv_transfer_config: Any) -> dict[str, Any]:
    """The extra config of the guarded connector: its own, or its ``MultiConnector``
    entry's."""
    extra = kv_transfer_config.kv_connector_extra_config or {}
    if kv_transfer_config.kv_connector != "MultiConnector":
        return dict(extra)
    for child in extra.get("connectors", ()):
        if child.get("kv_connector") == GuardedSimpleCPUOffloadConnector.__name__:
            return dict(child.get("kv_connector_extra_config") or {})
    return {}
