"""``GuardedOffloadingConnector``: vLLM's ``OffloadingConnector`` behind kvguard's tier gate.

vLLM's connector picks its store jobs while a step is being *scheduled*
(``_build_store_jobs``), from ``num_computed_tokens + num_scheduled_tokens``: the step
being scheduled has not run yet, so stock vLLM copies KV to the CPU tier before anyone
knows whether it is finite (and, at a request's end, up to ``num_tokens - 1`` even if
the request failed). This subclass changes the scheduler side only; workers run vLLM's
code unchanged.

* **Store jobs cover validated blocks only.** Before vLLM builds the step's store jobs,
  the offloadable range of each request is clamped to its leading blocks that kvguard
  holds as VALIDATED/PUBLISHED/OFFLOADED *with this request's hash at that position*;
  vLLM's chunk pointer stops there, so a chunk is offered again at the first step
  after the step that filled it validated. A quarantined or still-unchecked chunk is
  never offered, not even when its request finishes. (The clamp rides on vLLM's own
  per-request ``max_offload_tokens``; a running request's prefix-hit chunks wait for
  its own first chunks, to be offered in one call as stock vLLM offers them.)
* **One ``StoreTicket`` per source block** (``BlockPool.begin_store``) for every job
  vLLM builds; a job with a block the core refuses is cancelled (never reaches a
  worker) -- a second line behind the clamp.
* **Acknowledgements go through ``ack_store``.** When the workers report a store job
  complete, each chunk's tickets are acknowledged; a chunk with a ticket the core
  rejects (its block was quarantined, invalidated, evicted or reused since the copy
  began) is discarded from the tier (``OffloadingManager.complete_store(keys,
  success=False)``) instead of becoming loadable; its other blocks' tier records are
  withdrawn (``forget_tier_copy``).
* A cache reset fails the tickets of the jobs it flushes (``fail_store``).
* **kvguard's record of tier copies follows the tier.** A chunk the CPU tier evicts
  (to make room for a store: ``prepare_store``'s ``evicted_keys``) or drops in a cache
  reset has its blocks' records withdrawn, so ``tier_copies`` names only chunks the
  tier holds, and the record stays the tier's size on a server that runs for weeks.
* **Invalidated copies are purged** (:mod:`kvguard.adapters.vllm.exits.tier_purge`): bound to
  kvguard's pool, the connector registers a purger for its tier. Each chunk holding an
  invalidated hash leaves vLLM's CPU manager as an eviction would (its CPU chunk is
  free again, a removal event goes out), the chunk as a whole: its other blocks'
  records are withdrawn. A chunk being loaded (pinned by vLLM's manager) is kept out
  of every lookup at once and dropped when its last load completes -- the workers
  are reading its CPU chunk, which must not be handed to a store before. A chunk
  whose store is still running needs no purge: its tickets fail at the
  acknowledgement (the invalidation changed its blocks), which discards it. Only
  vLLM's own ``CPUOffloadingManager`` is purged; under another manager (tiering, an
  out-of-tree spec) invalidated copies are reported unpurged.

Without kvguard's pool underneath (stock scheduler, or the guard off: vLLM's own
scheduler and pool) it is vLLM's ``OffloadingConnector``. Select it with
``KVTransferConfig(kv_connector="GuardedOffloadingConnector",
kv_connector_module_path="kvguard.adapters.vllm.exits.offloading")``, or let the plugin
(``KVGUARD_GUARD=1``) substitute it for ``OffloadingConnector``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from contextlib import nullcontext
from itertools import chain
from typing import Any

from kvguard.adapters.vllm._compat import (
    offload_hooks_are_locked,
    require_supported_vllm,
    store_job_failed,
)

require_supported_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1 import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (  # noqa: E402
    build_offloading_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (  # noqa: E402
    OffloadingConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (  # noqa: E402
    OffloadingConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: E402
    OffloadingConnector,
)
from vllm.logger import init_logger  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    resolve_block_hashes,
)
from vllm.v1.kv_offload.base import LookupResult, OffloadingEvent  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

from kvguard.adapters.vllm.metrics import CONNECTOR_HELP  # noqa: E402
from kvguard.adapters.vllm.pool.block_pool import GuardedBlockPool, group_suffix  # noqa: E402
from kvguard.errors import NotStorableError  # noqa: E402
from kvguard.hashing import BlockHash  # noqa: E402
from kvguard.results import StoreTicket  # noqa: E402
from kvguard.states import STORABLE_STATES  # noqa: E402

logger = init_logger(f"vllm.{__name__}")
"""Under vLLM's logger, as the scheduler's: vLLM's handler, format and level apply."""

TIER = "vllm-offload"
"""The tier name kvguard records the connector's copies under (``tier_copies``)."""


def fail_tickets(core: Any, by_key: dict[Any, list[StoreTicket]]) -> None:
    """Fail every ticket of a store job (offload key -> its blocks' tickets): none of
    its copies becomes a tier copy in kvguard."""
    for taken in by_key.values():
        for ticket in taken:
            core.fail_store(ticket)


def drop_idle_chunks(manager: CPUOffloadingManager, chunks: list[tuple[Any, Any]]) -> None:
    """Remove ready chunks no transfer uses ((offload key, chunk status) pairs) from
    vLLM's CPU manager, as its ``prepare_store`` evicts them: out of the cache policy,
    their CPU chunks back on the free list, one removal event (the KV events name them
    gone). vLLM's manager has no call for it; these internals are the same in every
    supported series."""
    for key, chunk in chunks:
        manager._policy.remove(key)
        manager._num_evictable_cache_chunks -= 1
        manager._free_chunk(chunk)
    if chunks and manager.events is not None:
        keys = [key for key, _ in chunks]
        manager.events.append(OffloadingEvent(keys=keys, medium=manager.medium, removed=True))


class GuardedOffloadingConnectorScheduler(OffloadingConnectorScheduler):
    """The scheduler side of :class:`GuardedOffloadingConnector`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kvguard_kv_cache_manager: Any = None
        # Store job id -> offload key -> the tickets of the blocks that chunk copies.
        self._kvguard_tickets: dict[int, dict[Any, list[StoreTicket]]] = {}
        # Offload key -> the block hashes kvguard records a tier copy of for it: what
        # to forget when the tier evicts the chunk (at most one entry per chunk the
        # tier holds, so kvguard's record of tier copies stays the tier's size).
        self._kvguard_stored: dict[Any, tuple[BlockHash, ...]] = {}
        # Offload keys of purged chunks still being loaded: out of every lookup, dropped
        # from the tier when their last load completes (see _kvguard_purge).
        self._kvguard_purging: set[Any] = set()
        self._kvguard_observe_tier_evictions()
        if type(self.manager) is CPUOffloadingManager:
            self._kvguard_observe_loads()
        self.kvguard_counters = dict.fromkeys(CONNECTOR_HELP, 0)

    def _kvguard_observe_tier_evictions(self) -> None:
        """The offloading manager evicts chunks only to make room for a store, and
        says which in ``prepare_store``'s result (``evicted_keys``); vLLM keeps no other
        record of them. Read it there."""
        manager = self.manager
        prepare_store = manager.prepare_store

        def observed_prepare_store(keys: Collection[Any], req_context: Any) -> Any:
            out = prepare_store(keys, req_context)
            if out is not None and out.evicted_keys:
                self.kvguard_counters["offload_chunks_evicted"] += len(out.evicted_keys)
                self._kvguard_forget_chunks(out.evicted_keys)
            return out

        manager.prepare_store = observed_prepare_store

    def _kvguard_forget_chunks(self, keys: Collection[Any]) -> None:
        """The tier no longer holds these chunks: forget kvguard's record of their
        blocks' copies."""
        stored = self._kvguard_stored
        pool = self.kvguard_pool()
        for key in keys:
            hashes = stored.pop(key, ())
            if pool is not None:
                for block_hash in hashes:
                    pool.core.forget_tier_copy(TIER, block_hash)

    def kvguard_bind(self, kv_cache_manager: Any) -> None:
        """Bind to the scheduler's KV cache manager: vLLM's pool at first, kvguard's
        once the guarded scheduler installed it and binds the connectors again; then
        the tier's purger is registered with kvguard's pool."""
        self._kvguard_kv_cache_manager = kv_cache_manager
        pool = self.kvguard_pool()
        if pool is None:
            return
        if type(self.manager) is CPUOffloadingManager:
            pool.tier_purgers.add(TIER, self._kvguard_purge)
        else:
            logger.warning(
                "kvguard: the offloading connector's manager is %s, not vLLM's "
                "CPUOffloadingManager: copies of KV invalidated after the fact cannot be "
                "purged from its tiers (each invalidation reports them unpurged)",
                type(self.manager).__name__,
            )

    def kvguard_pool(self) -> GuardedBlockPool | None:
        """kvguard's pool under the scheduler, or None (vLLM's own pool: stock vLLM or
        the guard off; the connector is then vLLM's own)."""
        manager = self._kvguard_kv_cache_manager
        pool = getattr(manager, "block_pool", None)
        return pool if isinstance(pool, GuardedBlockPool) else None

    # ------------------------------------------------------------------ store admission

    def _kvguard_group_views(self, pool: GuardedBlockPool) -> list[tuple[int, bytes, bool]]:
        """Per KV cache group the connector stores: its block size, the suffix its
        hashes carry in kvguard's keys (make_block_hash_with_group_id(h, g) is h + g's 4
        big-endian bytes), and whether the request's hashes need a view at that size."""
        return [
            (
                config.tokens_per_block,
                group_suffix(config.group_idx),
                config.tokens_per_block != pool.hash_block_size,
            )
            for config in self.config.kv_group_configs
        ]

    def _kvguard_validated_tokens(
        self, pool: GuardedBlockPool, groups: list[tuple[int, bytes, bool]], req_status: Any
    ) -> int:
        """Tokens of the request's leading blocks kvguard allows to be stored: each
        block VALIDATED or later and carrying this request's hash for its position.

        Called for every scheduled request at every step, so it reads kvguard's block
        records (the objects vLLM holds as its blocks) instead of asking the pool per
        block; usually the first block past vLLM's chunk pointer stops it."""
        records = pool.blocks
        blocks_per_chunk = self.config.blocks_per_chunk
        request_hashes = req_status.req.block_hashes
        limit = -1
        views = zip(groups, req_status.group_states, strict=True)
        for (block_size, suffix, resized), group_state in views:
            hashes = (
                resolve_block_hashes(request_hashes, pool.hash_block_size, block_size)
                if resized
                else request_hashes
            )
            block_ids = group_state.block_ids
            end = min(len(block_ids), len(hashes))
            # Chunks before vLLM's pointer were offered already; only newer ones count.
            n = min(group_state.next_stored_chunk_idx * blocks_per_chunk, end)
            while n < end:
                block_id = block_ids[n]
                if not block_id:
                    break  # the null block (outside a window)
                block = records[block_id]
                if block.state not in STORABLE_STATES or block.block_hash != hashes[n] + suffix:
                    break  # unvalidated, or reused for other tokens since this request held it
                n += 1
            tokens = n * block_size
            if limit < 0 or tokens < limit:
                limit = tokens
        return max(limit, 0)

    def _kvguard_hold_back_hits(
        self, groups: list[tuple[int, bytes, bool]], req_status: Any, limit: int
    ) -> int:
        """``limit`` for a request whose storable blocks past vLLM's chunk pointer are
        all prefix-cache hits: while it is running, nothing, until its own first blocks
        validate too -- then vLLM offers both in one ``prepare_store`` call, as stock
        vLLM does at admission (the hit chunks most often are in the tier already; a
        request that ends first offers them when it finishes)."""
        if req_status.req.is_finished():
            return limit
        blocks_per_chunk = self.config.blocks_per_chunk
        offered = min(
            group_state.next_stored_chunk_idx * blocks_per_chunk * block_size
            for (block_size, _, _), group_state in zip(groups, req_status.group_states, strict=True)
        )
        return min(limit, offered)

    def _build_store_jobs(self, scheduler_output: Any) -> dict[int, Any]:
        pool = self.kvguard_pool()
        if pool is None:
            return super()._build_store_jobs(scheduler_output)
        # While vLLM builds the step's store jobs, each request's offloadable range is
        # clamped by vLLM's own per-request knob, ``max_offload_tokens`` (a request's
        # kv_transfer_params setting, read by _calc_num_offloadable_tokens alone
        # there), lowered to what kvguard allows; the request's own value comes back
        # after.
        statuses = self._req_status
        validated_tokens = self._kvguard_validated_tokens
        groups = self._kvguard_group_views(pool)
        clamped: list[tuple[Any, int | None]] = []
        try:
            for req_id in chain(
                scheduler_output.num_scheduled_tokens, scheduler_output.finished_req_ids or ()
            ):
                req_status = statuses.get(req_id)
                if req_status is None:
                    continue
                limit = validated_tokens(pool, groups, req_status)
                if limit <= req_status.num_locally_computed_tokens:
                    limit = self._kvguard_hold_back_hits(groups, req_status, limit)
                own = req_status.max_offload_tokens
                clamped.append((req_status, own))
                if own is None or limit < own:
                    req_status.max_offload_tokens = limit
            jobs = super()._build_store_jobs(scheduler_output)
        finally:
            for req_status, own in reversed(clamped):
                req_status.max_offload_tokens = own
        return self._kvguard_admit(pool, jobs)

    def _build_partial_tail_store_jobs(self, scheduler_output: Any) -> dict[int, Any]:
        jobs = super()._build_partial_tail_store_jobs(scheduler_output)
        pool = self.kvguard_pool()
        if pool is None or not jobs:
            return jobs
        return self._kvguard_admit(pool, jobs)

    def _kvguard_key_blocks(self, job: Any, status: Any) -> dict[Any, list[int]]:
        """Offload key -> the GPU blocks the job copies for it."""
        req_status = self._req_status[job.req_id]
        wanted = status.keys
        blocks_per_chunk = self.config.blocks_per_chunk
        out: dict[Any, list[int]] = {}
        for group_state in req_status.group_states:
            keys = group_state.offload_keys
            block_ids = group_state.block_ids
            # The chunks just offered are the newest: scan from the end.
            for chunk in range(len(keys) - 1, -1, -1):
                key = keys[chunk]
                if key in wanted and key not in out:
                    start = chunk * blocks_per_chunk
                    out[key] = [b for b in block_ids[start : start + blocks_per_chunk] if b]
                    if len(out) == len(wanted):
                        return out
        # Keys not in the request's chunk list (boundary stores): all the job's blocks.
        every = [int(b) for b in job.src_spec.block_ids]
        for key in wanted:
            out.setdefault(key, every)
        return out

    def _kvguard_admit(self, pool: GuardedBlockPool, jobs: dict[int, Any]) -> dict[int, Any]:
        """Take a ticket per source block of each job; cancel a job kvguard refuses."""
        core = pool.core
        counters = self.kvguard_counters
        for job_id in list(jobs):
            status = self._jobs[job_id]
            tickets: dict[Any, list[StoreTicket]] = {}
            refused: int | None = None
            for key, block_ids in self._kvguard_key_blocks(jobs[job_id], status).items():
                taken = tickets.setdefault(key, [])
                for block_id in block_ids:
                    try:
                        taken.append(core.begin_store(block_id, TIER))
                    except NotStorableError:
                        refused = block_id
                        break
                if refused is not None:
                    break
            if refused is None:
                self._kvguard_tickets[job_id] = tickets
                counters["offload_store_jobs"] += 1
                continue
            fail_tickets(core, tickets)
            logger.warning(
                "kvguard: store job %d of request %s copies block %d, which is not "
                "validated; the job is cancelled",
                job_id,
                status.req_id,
                refused,
            )
            self._kvguard_cancel(job_id, jobs.pop(job_id).req_id, status)
            counters["offload_store_jobs_cancelled"] += 1
        return jobs

    def _kvguard_cancel(self, job_id: int, req_id: str, status: Any) -> None:
        """Undo a store job vLLM just built (it never reaches a worker)."""
        req_status = self._req_status[req_id]
        self.manager.complete_store(status.keys, req_status.req_context, success=False)
        req_status.transfer_jobs.discard(job_id)
        del self._jobs[job_id]
        for block_ids in (status.fenced_block_ids, status.deferred_fence_block_ids):
            for block_id in block_ids or ():
                pending = self._block_id_to_pending_jobs.get(block_id)
                if pending is not None:
                    pending.discard(job_id)
                    if not pending:
                        del self._block_id_to_pending_jobs[block_id]
        self._current_batch_jobs_to_flush.discard(job_id)
        # Offer its chunks again once kvguard allows them.
        for group_state in req_status.group_states:
            for chunk, key in enumerate(group_state.offload_keys):
                if key in status.keys:
                    group_state.next_stored_chunk_idx = min(
                        group_state.next_stored_chunk_idx, chunk
                    )
                    break

    # ------------------------------------------------------------------ acknowledgements

    def _kvguard_take_acknowledgements(self, connector_output: Any) -> None:
        """Before vLLM completes the store jobs the workers report finished."""
        meta = connector_output.kv_connector_worker_meta
        tickets = self._kvguard_tickets
        if tickets and isinstance(meta, OffloadingWorkerMetadata):
            for job_id, count in meta.completed_jobs.items():
                if job_id not in tickets:
                    continue
                status = self._jobs.get(job_id)
                if status is None:
                    continue
                if store_job_failed(meta, job_id, status):
                    # vLLM drops a failed job's copies (once every worker reported):
                    # kvguard records none, now.
                    self._kvguard_fail_job(job_id)
                elif status.pending_count <= count:  # else other workers still copying
                    self._kvguard_acknowledge(job_id, status)

    def _kvguard_fail_job(self, job_id: int) -> None:
        """A worker reports the store job failed (vLLM 0.34): its tickets fail, and no
        chunk of it is recorded as a tier copy."""
        by_key = self._kvguard_tickets.pop(job_id)
        pool = self.kvguard_pool()
        if pool is not None:
            fail_tickets(pool.core, by_key)
        self.kvguard_counters["offload_store_jobs_failed"] += 1

    def _kvguard_acknowledge(self, job_id: int, status: Any) -> None:
        """Every worker finished the job: register its copies in kvguard; a chunk
        whose block changed since the copy began is discarded from the tier."""
        pool = self.kvguard_pool()
        by_key = self._kvguard_tickets.pop(job_id)
        if pool is None:
            return
        core = pool.core
        discard: list[Any] = []
        stored = self._kvguard_stored
        ack = core.ack_store
        for key, taken in by_key.items():  # (one chunk each: per stored chunk, lean)
            acks = [ack(ticket) for ticket in taken]
            if False not in acks:
                stored[key] = tuple([ticket.block_hash for ticket in taken])
                continue
            for ticket, ok in zip(taken, acks, strict=True):
                if ok:  # the chunk goes as a whole
                    core.forget_tier_copy(TIER, ticket.block_hash)
            discard.append(key)
        counters = self.kvguard_counters
        counters["offload_chunks_stored"] += len(by_key) - len(discard)
        if discard:
            counters["offload_chunks_discarded"] += len(discard)
            # (The job's keys: a set before vLLM 0.34, a tuple in prefix order since.)
            status.keys = type(status.keys)(k for k in status.keys if k not in discard)
            req_status = self._req_status[status.req_id]
            self.manager.complete_store(discard, req_status.req_context, success=False)

    # ------------------------------------------------------------------ purging

    def _kvguard_purge(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """The tier's purger (:mod:`kvguard.adapters.vllm.exits.tier_purge`): drop every chunk
        holding one of ``hashes`` (kvguard's keys) from vLLM's CPU manager; returns
        those hashes whose copy was dropped.

        A chunk goes as a whole, so the records of its other blocks are withdrawn too
        (unless another chunk the tier holds has them). Invalidations are rare: this
        scans kvguard's record of the tier's chunks rather than keep an index by hash
        on the store path."""
        wanted = set(hashes)
        stored = self._kvguard_stored
        chunks = [key for key, held in stored.items() if not wanted.isdisjoint(held)]
        if not chunks:
            return []
        purged: dict[BlockHash, None] = {}
        others: set[BlockHash] = set()
        idle: list[tuple[Any, Any]] = []
        dropped = 0
        with self._kvguard_manager_lock():
            manager = self.manager
            for key in chunks:
                held = stored.pop(key)
                others.update(held)
                chunk = manager._policy.get(key)
                if chunk is None or not chunk.is_ready:
                    # Not in the tier, or stored again and still being written
                    # (kvguard records a chunk once its store completed): that store's
                    # tickets fail at its acknowledgement, which discards it.
                    continue
                if chunk.ref_cnt > 0:
                    # Being loaded: the workers read its CPU chunk, which must not go
                    # to a store before they are done. It leaves every lookup now.
                    self._kvguard_purging.add(key)
                else:
                    idle.append((key, chunk))
                purged.update((h, None) for h in held if h in wanted)
                dropped += 1
            drop_idle_chunks(manager, idle)
        # (The core dropped its record of ``hashes`` itself, when it invalidated them.)
        others.difference_update(wanted)
        pool = self.kvguard_pool()
        if others and pool is not None:
            others.difference_update(chain.from_iterable(stored.values()))
            for block_hash in others:
                pool.core.forget_tier_copy(TIER, block_hash)
        self.kvguard_counters["offload_chunks_purged"] += dropped
        return list(purged)

    def _kvguard_observe_loads(self) -> None:
        """A purged chunk being loaded is a miss for every lookup, and leaves the tier
        when its last load completes (``complete_load``)."""
        manager = self.manager
        lookup = manager.lookup
        complete_load = manager.complete_load
        purging = self._kvguard_purging
        miss = LookupResult.MISS

        def observed_lookup(key: Any, req_context: Any) -> Any:
            if purging and key in purging:
                return miss
            return lookup(key, req_context)

        def observed_complete_load(keys: Collection[Any], req_context: Any) -> None:
            complete_load(keys, req_context)
            if purging:
                get = manager._policy.get
                found = [(key, get(key)) for key in purging.intersection(keys)]
                done = [(k, chunk) for k, chunk in found if chunk is not None and not chunk.ref_cnt]
                purging.difference_update(key for key, _ in done)
                drop_idle_chunks(manager, done)

        manager.lookup = observed_lookup
        manager.complete_load = observed_complete_load

    def _kvguard_manager_lock(self) -> Any:
        """The offloading manager's lock, which every caller of the manager holds
        (vLLM 0.33 on; 0.32's manager has none)."""
        return self.manager.lock if offload_hooks_are_locked() else nullcontext()

    # ------------------------------------------------------------------ cache reset

    def _kvguard_fail_in_flight(self) -> None:
        """A cache reset flushes every job in flight: their tickets fail."""
        pool = self.kvguard_pool()
        if pool is not None:
            for by_key in self._kvguard_tickets.values():
                fail_tickets(pool.core, by_key)
        self._kvguard_tickets.clear()

    # vLLM's hooks for the workers' output and for a cache reset: under the offloading
    # manager's lock where vLLM has one (see _compat.offload_hooks_are_locked).
    if offload_hooks_are_locked():

        def _update_connector_output(self, connector_output: Any) -> None:
            self._kvguard_take_acknowledgements(connector_output)
            super()._update_connector_output(connector_output)

        def _reset_cache(self) -> None:
            self._kvguard_fail_in_flight()
            super()._reset_cache()  # empties the tier
            self._kvguard_purging.clear()
            self._kvguard_forget_chunks(list(self._kvguard_stored))

    else:

        def update_connector_output(self, connector_output: Any) -> None:
            self._kvguard_take_acknowledgements(connector_output)
            super().update_connector_output(connector_output)

        def reset_cache(self) -> None:
            self._kvguard_fail_in_flight()
            super().reset_cache()  # empties the tier
            self._kvguard_purging.clear()
            self._kvguard_forget_chunks(list(self._kvguard_stored))

    def kvguard_in_flight(self) -> dict[int, Collection[Any]]:
        """Store job id -> offload keys of the jobs whose acknowledgement is due."""
        return {job_id: tuple(by_key) for job_id, by_key in self._kvguard_tickets.items()}


class GuardedOffloadingConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector`` whose store jobs pass kvguard's tier gate."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        # OffloadingConnector.__init__ with the guarded scheduler side (the same in
        # vLLM 0.32 and 0.33).
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        offloading_config = build_offloading_config(vllm_config, kv_cache_config)
        self._canonical_layout = offloading_config.canonical_layout
        spec = OffloadingSpecFactory.create_spec(offloading_config)
        self.connector_scheduler: GuardedOffloadingConnectorScheduler | None = None
        self.connector_worker: OffloadingConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = GuardedOffloadingConnectorScheduler(
                spec, vllm_config, kv_cache_config
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = OffloadingConnectorWorker(spec, vllm_config, kv_cache_config)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.connector_scheduler is not None:
            # Read at use: the guarded scheduler installs kvguard's pool afterwards.
            self.connector_scheduler.kvguard_bind(kv_cache_manager)

    def kvguard_stats(self) -> dict[str, int]:
        if self.connector_scheduler is None:
            return {}
        return dict(self.connector_scheduler.kvguard_counters)
