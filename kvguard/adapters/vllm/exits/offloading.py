"""``GuardedOffloadingConnector``: vLLM's ``OffloadingConnector`` behind kvguard's tier gate.

vLLM's connector picks its store jobs while a step is being *scheduled*
(``_build_store_jobs``), from ``num_computed_tokens + num_scheduled_tokens``: the step
being scheduled has not run yet, so stock vLLM copies KV to the CPU tier before anyone
knows whether it is finite (and, at a request's end, up to ``num_tokens - 1`` even if
the request failed). This subclass changes the scheduler side only, as a thin adapter
from vLLM's hooks to kvguard's exit gate (:mod:`.gate`: the rule, the tickets, the
record of the tier's chunks, the purge registration and the counters); workers run
vLLM's code unchanged.

* **Store jobs cover validated blocks only.** Before vLLM builds the step's store jobs,
  the offloadable range of each request vLLM may offer a new chunk of is clamped to
  its validated frontier (the gate's): its leading blocks VALIDATED or later *with
  this request's key at that position*;
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

* **Loads are verified by their seals** (seals on: ``{"kvguard": {"seal": true}}``).
  Each chunk the tier holds carries its blocks' seals, taken when their step
  validated (the gate's tier record). A load job carries the seal of every GPU block
  it fills (``kvguard_load_seals`` on the connector metadata); when the job completes,
  the worker seals the blocks it filled and reports those that differ as blocks that
  failed to load (``get_block_ids_with_load_errors``): vLLM's
  ``kv_load_failure_policy`` recomputes the request from the first of them, or fails
  it, and every other request proceeds. The scheduler side drops the rotten chunk and
  the chunks of that load after it from the tier, counts the load
  (``offload_loads_refused``) and logs it once with the request. A copy without a
  seal is refused as well. vLLM maps such block-level failures to requests on models
  with one KV cache group only: with seals on, a model with several is refused at
  start-up.

Without kvguard's pool underneath (stock scheduler, or the guard off: vLLM's own
scheduler and pool) it is vLLM's ``OffloadingConnector``. Select it with
``KVTransferConfig(kv_connector="GuardedOffloadingConnector",
kv_connector_module_path="kvguard.adapters.vllm")``, or let the plugin
(``KVGUARD_GUARD=1``) substitute it for ``OffloadingConnector``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING, Any

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
from vllm.v1.kv_offload.base import LookupResult, OffloadingEvent  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

from kvguard.adapters.vllm.config import guard_config  # noqa: E402
from kvguard.adapters.vllm.exits.gate import (  # noqa: E402
    LOAD_SEALS,
    ExitGate,
    group_hashes,
    group_key,
    refuse_seals_for_groups,
)
from kvguard.adapters.vllm.metrics import CONNECTOR_HELP  # noqa: E402
from kvguard.adapters.vllm.workers.seals import LoadVerifier  # noqa: E402
from kvguard.hashing import BlockHash  # noqa: E402
from kvguard.results import StoreTicket  # noqa: E402

if TYPE_CHECKING:
    from kvguard.adapters.vllm.pool.block_pool import GuardedBlockPool

logger = init_logger(f"vllm.{__name__}")
"""Under vLLM's logger, as the scheduler's: vLLM's handler, format and level apply."""

TIER = "vllm-offload"
"""The tier name kvguard records the connector's copies under (``tier_copies``)."""


@dataclass(slots=True)
class _SealedLoad:
    """A load job whose blocks the workers verify: what the scheduler side needs when
    they report a block that does not."""

    req_id: str
    seals: dict[int, int | None]
    """GPU block -> the seal its copy carries (sent to the workers)."""
    chunks: list[tuple[Any, list[int]]] = field(default_factory=list)
    """The job's chunks in prefix order: offload key, the GPU blocks it fills."""
    refused: bool = False


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
    """The scheduler side of :class:`GuardedOffloadingConnector`: vLLM's hooks
    translated to kvguard's exit gate (:attr:`kvguard_gate`, whose copies are the CPU
    tier's chunks, by offload key)."""

    def __init__(self, spec: Any, vllm_config: Any, kv_cache_config: Any) -> None:
        super().__init__(spec, vllm_config, kv_cache_config)
        self.kvguard_gate = ExitGate(TIER, CONNECTOR_HELP)
        # Seals on: each load job's blocks are verified by the workers (job id -> its
        # blocks' seals and chunks, until the job completes).
        self._kvguard_verify = guard_config(vllm_config).seal
        self._kvguard_loads: dict[int, _SealedLoad] = {}
        if self._kvguard_verify:
            refuse_seals_for_groups(kv_cache_config)
        self.kvguard_counters = self.kvguard_gate.counters
        # Store job id -> offload key -> the tickets of the blocks that chunk copies.
        self._kvguard_tickets: dict[int, dict[Any, list[StoreTicket]]] = {}
        # Offload keys of purged chunks still being loaded: out of every lookup, dropped
        # from the tier when their last load completes (see _kvguard_purge).
        self._kvguard_purging: set[Any] = set()
        # Per group the connector stores: its id, block size, and whether a request
        # holds its blocks while it runs -- a full-attention group's (a window's, a
        # local chunk's or a Mamba state's leave it, their ids staying in the table).
        self._kvguard_groups = tuple(
            (config.group_idx, config.tokens_per_block, i in self._full_attention_groups)
            for i, config in enumerate(self.config.kv_group_configs)
        )
        self._kvguard_blocks_per_chunk: int = self.config.blocks_per_chunk
        # Tokens per chunk in each group: vLLM offers whole chunks only.
        self._kvguard_chunk_tokens = [c.tokens_per_chunk for c in self.config.kv_group_configs]
        self._kvguard_observe_tier_evictions()
        if type(self.manager) is CPUOffloadingManager:
            self._kvguard_observe_loads()

    def _kvguard_observe_tier_evictions(self) -> None:
        """The offloading manager evicts chunks only to make room for a store, and
        says which in ``prepare_store``'s result (``evicted_keys``); vLLM keeps no other
        record of them. Read it there: the gate's record follows the tier."""
        manager = self.manager
        prepare_store = manager.prepare_store
        gate = self.kvguard_gate

        def observed_prepare_store(keys: Collection[Any], req_context: Any) -> Any:
            out = prepare_store(keys, req_context)
            if out is not None and out.evicted_keys:
                gate.count("offload_chunks_evicted", len(out.evicted_keys))
                gate.forget(out.evicted_keys)
            return out

        manager.prepare_store = observed_prepare_store

    def kvguard_bind(self, kv_cache_manager: Any) -> None:
        """Bind the gate to the scheduler's pool: vLLM's at first (the gate stays
        unbound, the connector vLLM's own), kvguard's once the guarded scheduler
        installed it and binds the connectors again; the tier's purger is registered
        with it."""
        pool = getattr(kv_cache_manager, "block_pool", None)
        purgeable = type(self.manager) is CPUOffloadingManager
        bound = self.kvguard_gate.bind(pool, self._kvguard_purge if purgeable else None)
        if bound is not None and not purgeable:
            logger.warning(
                "kvguard: the offloading connector's manager is %s, not vLLM's "
                "CPUOffloadingManager: copies of KV invalidated after the fact cannot be "
                "purged from its tiers (each invalidation reports them unpurged)",
                type(self.manager).__name__,
            )

    def kvguard_pool(self) -> GuardedBlockPool | None:
        """kvguard's pool under the scheduler, or None (vLLM's own pool: stock vLLM or
        the guard off; the connector is then vLLM's own)."""
        return self.kvguard_gate.pool

    # ------------------------------------------------------------------ store admission

    def _kvguard_validated_tokens(self, req_id: str, req_status: Any) -> int | None:
        """Tokens of the request's leading blocks the gate lets leave -- in every group
        its validated frontier, from vLLM's chunk pointer on (chunks before it were
        offered already) -- or None when vLLM can offer no new chunk of it: it is
        running and no group has a chunk past the pointer with every block allocated
        and its offload key made (vLLM's own bound, ``storable_chunks``: the min of the
        chunks offloadable, allocated and keyed). Most running requests have none at
        most steps, and cost no gate call."""
        blocks_per_chunk = self._kvguard_blocks_per_chunk
        group_states = req_status.group_states
        # A finished request's blocks are freed before vLLM stores them (its fences
        # keep them from being reused first): not held, verified at each call.
        finished = req_status.req.is_finished()
        if not finished:
            for group_state in group_states:
                allocated = len(group_state.block_ids) // blocks_per_chunk
                if min(allocated, len(group_state.offload_keys)) > (
                    group_state.next_stored_chunk_idx
                ):
                    break
            else:
                return None
        frontier = self.kvguard_gate.frontier
        request_hashes = req_status.req.block_hashes
        limit = -1
        for (group_id, block_size, held), group_state in zip(
            self._kvguard_groups, group_states, strict=True
        ):
            n = frontier(
                req_id,
                group_id,
                group_state.block_ids,
                request_hashes,
                block_size,
                group_state.next_stored_chunk_idx * blocks_per_chunk,
                held=held and not finished,
            )
            tokens = n * block_size
            if limit < 0 or tokens < limit:
                limit = tokens
        return max(limit, 0)

    def _kvguard_hold_back_hits(self, req_status: Any, limit: int) -> int:
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
            for (_, block_size, _), group_state in zip(
                self._kvguard_groups, req_status.group_states, strict=True
            )
        )
        return min(limit, offered)

    def _build_store_jobs(self, scheduler_output: Any) -> dict[int, Any]:
        gate = self.kvguard_gate
        if gate.pool is None:
            return super()._build_store_jobs(scheduler_output)
        # While vLLM builds the step's store jobs, each request's offloadable range is
        # clamped by vLLM's own per-request knob, ``max_offload_tokens`` (a request's
        # kv_transfer_params setting, read by _calc_num_offloadable_tokens alone
        # there), lowered to what kvguard allows; the request's own value comes back
        # after.
        statuses = self._req_status
        clamps: list[tuple[Any, int]] = []
        clears = gate.clears
        note_cleared = gate.note_cleared
        validated_tokens = self._kvguard_validated_tokens
        chunk_tokens = self._kvguard_chunk_tokens
        chunk = chunk_tokens[0] if len(chunk_tokens) == 1 else 0
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id, num_scheduled in scheduled.items():
            req_status = statuses.get(req_id)
            if req_status is None:
                continue
            req = req_status.req
            # vLLM offers no chunk past the tokens this step computes: when the gate
            # cleared those already (a decode step inside a block: most steps), there
            # is nothing to clamp, and no frontier to ask.
            offered = req.num_computed_tokens + num_scheduled
            if chunk:
                offered -= offered % chunk
            else:
                offered = max([offered - offered % t for t in chunk_tokens])
            if clears(req_id, req.num_preemptions, offered):
                continue
            limit = validated_tokens(req_id, req_status)
            if limit is not None:
                note_cleared(req_id, req.num_preemptions, limit)
                clamps.append((req_status, limit))
        for req_id in scheduler_output.finished_req_ids or ():
            req_status = statuses.get(req_id)
            if req_status is not None and req_id not in scheduled:
                limit = validated_tokens(req_id, req_status)
                if limit is not None:
                    clamps.append((req_status, limit))
        clamped: list[tuple[Any, int | None]] = []
        try:
            for req_status, limit in clamps:
                if limit <= req_status.num_locally_computed_tokens:
                    limit = self._kvguard_hold_back_hits(req_status, limit)
                own = req_status.max_offload_tokens
                clamped.append((req_status, own))
                if own is None or limit < own:
                    req_status.max_offload_tokens = limit
            jobs = super()._build_store_jobs(scheduler_output)
        finally:
            for req_status, own in reversed(clamped):
                req_status.max_offload_tokens = own
        if gate.num_frontiers() > 2 * len(self.config.kv_group_configs) * len(statuses) + 64:
            gate.forget_requests(statuses)  # (amortized: requests gone since)
        return self._kvguard_admit(jobs)

    def _build_partial_tail_store_jobs(self, scheduler_output: Any) -> dict[int, Any]:
        jobs = super()._build_partial_tail_store_jobs(scheduler_output)
        if self.kvguard_gate.pool is None or not jobs:
            return jobs
        return self._kvguard_admit(jobs)

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
                    out[key] = block_ids[start : start + blocks_per_chunk]
                    if len(out) == len(wanted):
                        return out
        # Keys not in the request's chunk list (boundary stores): all the job's blocks.
        every = [int(b) for b in job.src_spec.block_ids]
        for key in wanted:
            out.setdefault(key, every)
        return out

    def _kvguard_admit(self, jobs: dict[int, Any]) -> dict[int, Any]:
        """Open a ticket per source block of each job; cancel a job kvguard refuses."""
        gate = self.kvguard_gate
        for job_id in list(jobs):
            status = self._jobs[job_id]
            tickets: dict[Any, list[StoreTicket]] = {}
            refused: int | None = None
            for key, block_ids in self._kvguard_key_blocks(jobs[job_id], status).items():
                taken = gate.open_all(block_ids)
                if isinstance(taken, int):
                    refused = taken
                    break
                tickets[key] = taken
            if refused is None:
                self._kvguard_tickets[job_id] = tickets
                gate.count("offload_store_jobs")
                continue
            gate.fail(chain.from_iterable(tickets.values()))
            logger.warning(
                "kvguard: store job %d of request %s copies block %d, which is not "
                "validated; the job is cancelled",
                job_id,
                status.req_id,
                refused,
            )
            self._kvguard_cancel(job_id, jobs.pop(job_id).req_id, status)
            gate.count("offload_store_jobs_cancelled")
        return jobs

    def _kvguard_cancel(self, job_id: int, req_id: str, status: Any) -> None:
        """Undo a store job vLLM just built (it never reaches a worker)."""
        self.kvguard_gate.forget_cleared(req_id)
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

    # ------------------------------------------------------------------ verified loads

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        jobs = self._current_batch_load_jobs
        before = len(jobs)
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if self._kvguard_verify and len(jobs) > before and self.kvguard_gate.pool is not None:
            job_id = next(reversed(jobs))  # (the job vLLM just built: the newest)
            self._kvguard_loads[job_id] = self._kvguard_expect(request, jobs[job_id])

    def _kvguard_expect(self, request: Any, job: Any) -> _SealedLoad:
        """The seal each GPU block of load ``job`` must give: the one the tier's copy
        of the request's block at that position carries (the gate's record)."""
        pool = self.kvguard_gate.pool
        assert pool is not None
        tier_seal = pool.core.tier_gate.tier_seal
        spec = job.dst_spec
        block_ids = [int(b) for b in spec.block_ids]
        sizes = spec.group_sizes or (len(block_ids),)
        starts = spec.block_indices or (0,)
        req_status = self._req_status[request.request_id]
        load = _SealedLoad(request.request_id, {})
        chunk_of: dict[Any, list[int]] = {}
        blocks_per_chunk = self._kvguard_blocks_per_chunk
        offset = 0
        for (group_id, block_size, _), group_state, size, start in zip(
            self._kvguard_groups, req_status.group_states, sizes, starts, strict=True
        ):
            hashes = group_hashes(request.block_hashes, pool.hash_block_size, block_size)
            keys = group_state.offload_keys
            for k in range(size):
                block_id = block_ids[offset + k]
                position = start + k
                chunk = position // blocks_per_chunk
                if position < len(hashes) and chunk < len(keys):
                    load.seals[block_id] = tier_seal(group_key(hashes[position], group_id), TIER)
                    chunk_of.setdefault(keys[chunk], []).append(block_id)
                else:  # (a block past the request's full blocks: kvguard stores none)
                    load.seals[block_id] = None
            offset += size
        load.chunks = list(chunk_of.items())
        return load

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        loads = self._kvguard_loads
        if loads:
            sealed = {j: loads[j].seals for j in meta.load_jobs if j in loads}
            if sealed:
                setattr(meta, LOAD_SEALS, sealed)
        return meta

    def _kvguard_settle_loads(self, connector_output: Any, completed: dict[int, int]) -> None:
        """The workers' report on the verified loads: a load with a block that failed
        to load (did not verify) is refused -- its rotten chunk and the chunks after it
        leave the tier; a completed load is no longer tracked."""
        invalid = connector_output.invalid_block_ids
        loads = self._kvguard_loads
        for job_id, load in list(loads.items()):
            if invalid and not load.refused and not invalid.isdisjoint(load.seals):
                load.refused = True
                self._kvguard_refuse(load, invalid)
            count = completed.get(job_id)
            if count is not None:
                status = self._jobs.get(job_id)
                if status is None or status.pending_count <= count:
                    del loads[job_id]

    def _kvguard_refuse(self, load: _SealedLoad, invalid: set[int]) -> None:
        first = next(i for i, (_, ids) in enumerate(load.chunks) if not invalid.isdisjoint(ids))
        keys = [key for key, _ in load.chunks[first:]]
        dropped = self._kvguard_drop(keys)
        gate = self.kvguard_gate
        gate.count("offload_loads_refused")
        gate.count("offload_chunks_purged", len(dropped))
        bad = sum(1 for b in load.seals if b in invalid)
        logger.warning(
            "kvguard: request %s: %d block(s) it loaded from tier %s do not verify by "
            "their seals (the copy rotted, or is not the KV that validated); the load "
            "fails -- vLLM's kv_load_failure_policy decides whether the request recomputes "
            "or fails -- and %d chunk(s) are dropped from the tier",
            load.req_id,
            bad,
            TIER,
            len(dropped),
        )

    # ------------------------------------------------------------------ acknowledgements

    def _kvguard_take_acknowledgements(self, connector_output: Any) -> None:
        """Before vLLM completes the store jobs the workers report finished."""
        meta = connector_output.kv_connector_worker_meta
        if self._kvguard_loads:
            completed = meta.completed_jobs if isinstance(meta, OffloadingWorkerMetadata) else {}
            self._kvguard_settle_loads(connector_output, completed)
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
        self.kvguard_gate.fail(chain.from_iterable(by_key.values()))
        self.kvguard_gate.count("offload_store_jobs_failed")

    def _kvguard_acknowledge(self, job_id: int, status: Any) -> None:
        """Every worker finished the job: each chunk's copy is settled with the gate;
        a chunk whose block changed since the copy began is discarded from the tier."""
        gate = self.kvguard_gate
        by_key = self._kvguard_tickets.pop(job_id)
        if gate.pool is None:
            return
        discard = [key for key, taken in by_key.items() if not gate.settle(key, taken)]
        gate.count("offload_chunks_stored", len(by_key) - len(discard))
        if discard:
            gate.count("offload_chunks_discarded", len(discard))
            # (The job's keys: a set before vLLM 0.34, a tuple in prefix order since.)
            status.keys = type(status.keys)(k for k in status.keys if k not in discard)
            req_status = self._req_status[status.req_id]
            self.manager.complete_store(discard, req_status.req_context, success=False)

    # ------------------------------------------------------------------ purging

    def _kvguard_purge(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """The tier's purger (:mod:`kvguard.adapters.vllm.exits.tier_purge`): drop every chunk
        holding one of ``hashes`` (kvguard's keys) from vLLM's CPU manager; returns
        those hashes whose copy was dropped. A chunk goes as a whole: the gate
        withdraws the records of its other blocks (unless another chunk the tier holds
        has them)."""
        gate = self.kvguard_gate
        holding = gate.copies_holding(hashes)
        if not holding:
            return []
        dropped = self._kvguard_drop(holding)
        # (The core dropped its record of ``hashes`` itself, when it invalidated them.)
        gate.count("offload_chunks_purged", len(dropped))
        return gate.purged_keys((holding[key] for key in dropped), hashes)

    def _kvguard_drop(self, keys: Collection[Any]) -> list[Any]:
        """Drop the chunks of ``keys`` from vLLM's CPU manager and the gate's record;
        returns the keys of those the tier held (and drops). A chunk being loaded
        leaves every lookup now and the tier when its last load completes."""
        dropped: list[Any] = []
        if type(self.manager) is CPUOffloadingManager:
            idle: list[tuple[Any, Any]] = []
            with self._kvguard_manager_lock():
                manager = self.manager
                for key in keys:
                    chunk = manager._policy.get(key)
                    if chunk is None or not chunk.is_ready:
                        # Not in the tier, or stored again and still being written
                        # (kvguard records a chunk once its store completed): that
                        # store's tickets fail at its acknowledgement, which discards it.
                        continue
                    if chunk.ref_cnt > 0:
                        # Being loaded: the workers read its CPU chunk, which must not
                        # go to a store before they are done. It leaves every lookup now.
                        self._kvguard_purging.add(key)
                    else:
                        idle.append((key, chunk))
                    dropped.append(key)
                drop_idle_chunks(manager, idle)
        self.kvguard_gate.forget(keys)
        return dropped

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
        for by_key in self._kvguard_tickets.values():
            self.kvguard_gate.fail(chain.from_iterable(by_key.values()))
        self._kvguard_tickets.clear()
        self._kvguard_loads.clear()

    def _kvguard_tier_emptied(self) -> None:
        """The reset emptied the tier: the gate's record of it goes."""
        self._kvguard_purging.clear()
        self.kvguard_gate.forget(self.kvguard_gate.copies())

    # vLLM's hooks for the workers' output and for a cache reset: under the offloading
    # manager's lock where vLLM has one (see _compat.offload_hooks_are_locked).
    if offload_hooks_are_locked():

        def _update_connector_output(self, connector_output: Any) -> None:
            self._kvguard_take_acknowledgements(connector_output)
            super()._update_connector_output(connector_output)

        def _reset_cache(self) -> None:
            self._kvguard_fail_in_flight()
            super()._reset_cache()  # empties the tier
            self._kvguard_tier_emptied()

    else:

        def update_connector_output(self, connector_output: Any) -> None:
            self._kvguard_take_acknowledgements(connector_output)
            super().update_connector_output(connector_output)

        def reset_cache(self) -> None:
            self._kvguard_fail_in_flight()
            super().reset_cache()  # empties the tier
            self._kvguard_tier_emptied()

    def kvguard_in_flight(self) -> dict[int, Collection[Any]]:
        """Store job id -> offload keys of the jobs whose acknowledgement is due."""
        return {job_id: tuple(by_key) for job_id, by_key in self._kvguard_tickets.items()}


class GuardedOffloadingConnectorWorker(OffloadingConnectorWorker):
    """vLLM's offloading worker side, which verifies each sealed load job (seals on)
    when it completes: the blocks that do not give their copy's seal are reported as
    blocks that failed to load."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kvguard_loads = LoadVerifier()  # (by load job id)

    def start_kv_transfers(self, metadata: Any) -> None:
        self.kvguard_loads.expect(getattr(metadata, LOAD_SEALS, None))
        super().start_kv_transfers(metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        finished = super().get_finished(finished_req_ids)
        loads = self.kvguard_loads
        if loads.expected:
            completed = [j for j in loads.expected if j not in self._load_jobs]
            loads.verify(completed, skip=getattr(self._connector_worker_meta, "failed_jobs", ()))
        return finished


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
        self.connector_worker: GuardedOffloadingConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = GuardedOffloadingConnectorScheduler(
                spec, vllm_config, kv_cache_config
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = GuardedOffloadingConnectorWorker(
                spec, vllm_config, kv_cache_config
            )

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.connector_scheduler is not None:
            # Read at use: the guarded scheduler installs kvguard's pool afterwards.
            self.connector_scheduler.kvguard_bind(kv_cache_manager)

    def get_block_ids_with_load_errors(self) -> set[int]:
        refused = super().get_block_ids_with_load_errors()
        if self.connector_worker is None:
            return refused
        return set(refused) | self.connector_worker.kvguard_loads.take_refused()

    def kvguard_stats(self) -> dict[str, int]:
        if self.connector_scheduler is None:
            return {}
        return self.connector_scheduler.kvguard_gate.stats()
