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

This subclass changes the scheduler side only; workers run vLLM's code unchanged. It
is a thin adapter from vLLM's hooks to kvguard's exit gate
(:class:`~kvguard.adapters.vllm.exits.gate.ExitGate`), and reads no block record itself.

* **Stores copy validated blocks only.** In eager mode each request's blocks are cut,
  for vLLM's selection, at the gate's validated frontier (the first block past its
  store cursor that may not leave as this request's block at that position): vLLM's
  cursor waits there, so a block is offered at the first step after the step that
  filled it validated (vLLM's own selection, finding it unhashed on kvguard's pool,
  would pass over it for good), and a block a failed or never-validated step wrote is
  never offered, not even when its request finishes. Lazy mode walks kvguard's free
  queue (:class:`~kvguard.adapters.vllm.pool.block_pool.KvGuardFreeQueue`), where only
  published blocks carry a hash; the blocks it copied go back to the eviction end
  (vLLM's ``evict_first``, which kvguard's pool honours), as in stock vLLM.
* **One ticket per copied block** (the gate's, opened when a store event is built,
  whatever chose the block); a block the gate refuses (quarantined or invalidated
  since it was picked) is taken out of the event before any worker sees it.
* **Completions are settled with the gate.** When every worker reported a store event
  done, each block's copy is settled; a block whose ticket the core rejects
  (quarantined, invalidated or reused since the copy began) is not registered in the
  CPU tier's prefix cache: its CPU block goes back unhashed, so the copy never becomes
  loadable.
* A cache reset fails the tickets of the events it abandons.
* **kvguard's record of tier copies follows the tier**: the gate records each copy by
  its CPU block; one the CPU pool evicts, or drops in a reset, is forgotten (and the
  core's record of its hash withdrawn once no other CPU block holds it).
* **Invalidated copies are purged** (:mod:`kvguard.adapters.vllm.exits.tier_purge`): bound to
  kvguard's pool, the connector registers a purger for its tier, which drops each
  invalidated hash's CPU block from the CPU pool's prefix cache (``evict_blocks``: a
  removal event goes out), so it never hits again. A CPU block being loaded (pinned by
  its load) loses its hash at once too; it returns to the CPU pool's free list,
  unhashed, when the load releases it.

**Loads are verified by their seals** (seals on: ``{"kvguard": {"seal": true}}``), as
the offloading connector's (:mod:`.offloading`): each step's load event carries the
seal of every GPU block it fills, the one its CPU copy carries
(:data:`~kvguard.adapters.vllm.exits.gate.LOAD_SEALS`); when the workers report
the load done, they seal what they loaded and report the blocks that differ as blocks
that failed to load (vLLM's ``kv_load_failure_policy`` recomputes or fails the
request). The scheduler side drops the rotten CPU block and those after it in that
request's load, counts the load (``offload_loads_refused``) and logs it once with the
request. With seals on, a model with several KV cache groups is refused at start-up.

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
from typing import TYPE_CHECKING, Any

from kvguard.adapters.vllm._compat import (
    require_supported_vllm,
    simple_cpu_tier_sized_by_name,
)

require_supported_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (  # noqa: E402
    SimpleCPUOffloadConnector,
)
from vllm.logger import init_logger  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, RSWASpec  # noqa: E402
from vllm.v1.simple_kv_offload.manager import (  # noqa: E402
    SimpleCPUOffloadScheduler,
    TransferMeta,
)
from vllm.v1.simple_kv_offload.metadata import INVALID_JOB_ID  # noqa: E402

from kvguard.adapters.vllm.config import GuardConfigError, guard_config  # noqa: E402
from kvguard.adapters.vllm.exits.gate import (  # noqa: E402
    LOAD_SEALS,
    ExitGate,
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

TIER = "vllm-simple-cpu"
"""The tier name kvguard records the connector's copies under (``tier_copies``)."""

STOCK_NAME = "SimpleCPUOffloadConnector"
"""vLLM's name for the connector, which its engine core looks for."""


class GuardedSimpleCPUOffloadScheduler(SimpleCPUOffloadScheduler):
    """The scheduler side of :class:`GuardedSimpleCPUOffloadConnector`: vLLM's hooks
    translated to kvguard's exit gate (:attr:`kvguard_gate`, whose copies are the CPU
    tier's blocks, by CPU block id).

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

    kvguard_gate: ExitGate
    kvguard_counters: dict[str, int]
    _kvguard_tickets: dict[int, list[StoreTicket]]
    _kvguard_groups: tuple[tuple[int, int, bool], ...]
    _kvguard_verify: bool

    def kvguard_adopt(self, verify: bool = False) -> None:
        """Set up kvguard's state on a manager vLLM built (see the class doc);
        ``verify``: seals on, loads verified."""
        self.kvguard_gate = ExitGate(TIER, CONNECTOR_HELP)
        self._kvguard_verify = verify
        self.kvguard_counters = self.kvguard_gate.counters
        # Store event -> the tickets of the GPU blocks it copies, index-parallel with
        # its TransferMeta.gpu_block_ids.
        self._kvguard_tickets = {}
        # Per group eager mode stores: its id, block size, and whether a request holds
        # its blocks while it runs (full attention; a window's leave it, their ids
        # staying in the connector's table).
        groups = self.cpu_kv_cache_config.kv_cache_groups
        self._kvguard_groups = tuple(
            (g, self.group_block_sizes[g], _holds_its_blocks(groups[g].kv_cache_spec))
            for g in sorted(self.prefix_cacheable_group_ids)
        )
        self._kvguard_observe_cpu_pool()
        if self._gpu_block_pool is not None:
            self.kvguard_gate.bind(self._gpu_block_pool, self._kvguard_purge)

    def kvguard_pool(self) -> GuardedBlockPool | None:
        """kvguard's pool under the scheduler, or None (vLLM's own pool: stock vLLM or
        the guard off; the connector is then vLLM's own). The guarded scheduler binds
        the connector to kvguard's pool after it replaced vLLM's."""
        return self.kvguard_gate.pool

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        super().bind_gpu_block_pool(gpu_block_pool)
        gate = getattr(self, "kvguard_gate", None)  # (vLLM binds before kvguard_adopt)
        if gate is not None:
            gate.bind(gpu_block_pool, self._kvguard_purge)

    # ------------------------------------------------------------------ store selection

    def _select_eager_blocks_to_store(
        self, state: Any, block_ids_by_group: tuple[list[int], ...]
    ) -> Any:
        # Called per scheduled request and step. vLLM selects no block past the
        # request's computed tokens: while every group's store cursor is there already
        # (a decode step inside a block: most steps), there is nothing to cut.
        tokens = state.request.num_computed_tokens
        stored = state.num_stored_blocks
        for group_id, block_size, _ in self._kvguard_groups:
            if tokens // block_size > stored[group_id]:
                block_ids_by_group = self._kvguard_cut(state, block_ids_by_group)
                break
        return super()._select_eager_blocks_to_store(state, block_ids_by_group)

    def _kvguard_cut(
        self, state: Any, block_ids_by_group: tuple[list[int], ...]
    ) -> tuple[list[int], ...]:
        """Each group's block ids, cut at the gate's validated frontier: vLLM selects
        from the cut lists, so its store cursor waits there instead of passing over a
        block not validated yet, which it offers at the first step after its step
        validated. Null blocks (a window's freed positions) pass: vLLM stores the
        cached block of that position, if any (kvguard's index holds published blocks
        only)."""
        gate = self.kvguard_gate
        if gate.pool is None:
            return block_ids_by_group
        request = state.request
        hashes = request.block_hashes
        stored = state.num_stored_blocks
        cut: list[list[int]] | None = None
        for group_id, block_size, held in self._kvguard_groups:
            block_ids = block_ids_by_group[group_id]
            start = stored[group_id]
            if len(block_ids) <= start:
                continue
            n = gate.frontier(
                request.request_id,
                group_id,
                block_ids,
                hashes,
                block_size,
                start,
                null_passes=True,
                held=held,
            )
            if n < len(block_ids):
                if cut is None:
                    cut = list(block_ids_by_group)
                cut[group_id] = block_ids[:n]
        return block_ids_by_group if cut is None else tuple(cut)

    # Lazy mode: vLLM walks the GPU pool's free queue, kvguard's
    # (:class:`~kvguard.adapters.vllm.pool.block_pool.KvGuardFreeQueue`), where only
    # published blocks carry a hash; the gate's ticket at admission is the check.

    # ------------------------------------------------------------------ store admission

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        gate = self.kvguard_gate
        if gate.pool is not None:
            if meta.store_event != INVALID_JOB_ID:
                self._kvguard_admit(meta)
            if self._kvguard_verify and meta.load_event != INVALID_JOB_ID:
                self._kvguard_expect(meta)
            if gate.num_frontiers() > 2 * len(self._kvguard_groups) * len(self._reqs_to_store) + 64:
                gate.forget_requests(self._reqs_to_store)  # (amortized: requests gone since)
        return meta

    def _kvguard_admit(self, meta: Any) -> None:
        """A ticket per GPU block of the step's store event; blocks kvguard refuses
        leave the event before it reaches a worker (an event left empty is dropped)."""
        event = meta.store_event
        transfer = self._store_event_to_blocks[event]
        gate = self.kvguard_gate
        opened = gate.open_each(transfer.gpu_block_ids)
        tickets = [ticket for ticket in opened if ticket is not None]
        refused = [index for index, ticket in enumerate(opened) if ticket is None]
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
            gate.count("offload_store_jobs")
            return
        self._kvguard_drop_event(event)
        meta.store_event = INVALID_JOB_ID
        gate.count("offload_store_jobs_cancelled")

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

    # ------------------------------------------------------------------ verified loads

    def _kvguard_expect(self, meta: Any) -> None:
        """Send, with the step's load event, the seal each GPU block it fills must give:
        the one its CPU copy carries (None: the copy carries none, or kvguard has no
        record of it -- refused either way)."""
        pool = self.kvguard_gate.pool
        assert pool is not None
        tier_seal = pool.core.tier_gate.tier_seal
        recorded = self.kvguard_gate.recorded()
        seals: dict[int, int | None] = {}
        for gpu, cpu in zip(meta.load_gpu_blocks, meta.load_cpu_blocks, strict=True):
            keys = recorded.get(cpu)
            seals[gpu] = tier_seal(keys[0], TIER) if keys else None
        setattr(meta, LOAD_SEALS, {meta.load_event: seals})

    def update_connector_output(self, connector_output: Any) -> None:
        invalid = connector_output.invalid_block_ids
        if invalid and self._kvguard_verify and self.kvguard_gate.pool is not None:
            for req_id, state in self._reqs_to_load.items():
                if state.load_event is not None:
                    self._kvguard_refuse(req_id, state.transfer_meta, invalid)
        super().update_connector_output(connector_output)

    def _kvguard_refuse(self, req_id: str, transfer: Any, invalid: set[int]) -> None:
        """A request's load with a block the workers refused: its CPU block and those
        after it in the load leave the tier (a lookup stops at the first miss, so
        nothing past it is reachable under this prefix anyway)."""
        gpu_ids = transfer.gpu_block_ids
        first = next((i for i, b in enumerate(gpu_ids) if b in invalid), None)
        if first is None:
            return
        cpus = list(dict.fromkeys(transfer.cpu_block_ids[first:]))
        gate = self.kvguard_gate
        gate.forget(cpus)
        self.cpu_block_pool.evict_blocks(set(cpus))
        gate.count("offload_loads_refused")
        gate.count("offload_chunks_purged", len(cpus))
        logger.warning(
            "kvguard: request %s: %d block(s) it loaded from tier %s do not verify by "
            "their seals (the copy rotted, or is not the KV that validated); the load "
            "fails -- vLLM's kv_load_failure_policy decides whether the request recomputes "
            "or fails -- and %d CPU block(s) are dropped from the tier",
            req_id,
            sum(1 for b in gpu_ids if b in invalid),
            TIER,
            len(cpus),
        )

    # ------------------------------------------------------------------ acknowledgements

    def _process_store_event(self, event_idx: int) -> None:
        # Every worker finished the event: before vLLM registers its copies in the CPU
        # tier, each block's copy is settled with the gate.
        tickets = self._kvguard_tickets.pop(event_idx, None)
        transfer = self._store_event_to_blocks.get(event_idx)
        if tickets is not None and transfer is not None and self.kvguard_gate.pool is not None:
            self._kvguard_acknowledge(transfer, tickets)
        super()._process_store_event(event_idx)

    def _kvguard_acknowledge(self, transfer: Any, tickets: list[StoreTicket]) -> None:
        """Settle each copied block with the gate (the tier's copy: its CPU block); a
        block whose copy came too late leaves the event, so vLLM does not register it."""
        gate = self.kvguard_gate
        late = gate.settle_each(transfer.cpu_block_ids, tickets)
        gate.count("offload_chunks_stored", len(tickets) - len(late))
        if late:
            gate.count("offload_chunks_discarded", len(late))
            self._kvguard_take_out(transfer, late)

    # ------------------------------------------------------------------ cache reset

    def reset(self) -> bool:
        # vLLM abandons the store events in flight (their completions only release the
        # blocks): their tickets fail.
        for tickets in self._kvguard_tickets.values():
            self.kvguard_gate.fail(tickets)
        self._kvguard_tickets.clear()
        return bool(super().reset())

    # ------------------------------------------------------------------ the CPU tier

    def _kvguard_observe_cpu_pool(self) -> None:
        """The CPU tier is a vLLM ``BlockPool`` of its own. Every copy it drops leaves
        through ``_remove_cached_block_hashes`` (eviction to make room, ``evict_blocks``)
        or ``reset_prefix_cache``; both are observed, so that the gate's record of tier
        copies names only the CPU blocks that hold one."""
        cpu_pool = self.cpu_block_pool
        remove_hashes = cpu_pool._remove_cached_block_hashes
        reset_prefix_cache = cpu_pool.reset_prefix_cache
        gate = self.kvguard_gate

        def observed_remove(block: Any) -> Any:
            removed = remove_hashes(block)
            if removed and gate.holds(block.block_id):
                gate.count("offload_chunks_evicted", gate.forget((block.block_id,)))
            return removed

        def observed_reset() -> Any:
            done = reset_prefix_cache()
            if done:
                gate.forget(gate.copies())
            return done

        cpu_pool._remove_cached_block_hashes = observed_remove
        cpu_pool.reset_prefix_cache = observed_reset

    def _kvguard_purge(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """The tier's purger (:mod:`kvguard.adapters.vllm.exits.tier_purge`): drop the CPU
        blocks holding ``hashes`` (kvguard's keys, the CPU pool's too) from the CPU
        pool's prefix cache; returns the hashes whose copy was dropped. The tier may
        hold several copies of a hash (a duplicate stored while the first copy was in
        flight): every one goes. A block a load is reading keeps its bytes until the
        load releases it, unhashed: no lookup finds it meanwhile, and its space is free
        after."""
        gate = self.kvguard_gate
        holding = gate.copies_holding(hashes)
        if not holding:
            return []
        # (The core dropped its record of ``hashes`` itself, when it invalidated them;
        # forgotten before the eviction, which the observer would count as one.)
        gate.forget(holding)
        self.cpu_block_pool.evict_blocks(set(holding))
        gate.count("offload_chunks_purged", len(holding))
        return gate.purged_keys(holding.values(), hashes)

    def kvguard_in_flight(self) -> dict[int, tuple[int, ...]]:
        """Store event -> the GPU blocks of the events whose acknowledgement is due."""
        return {event: tuple(t.block_id for t in ts) for event, ts in self._kvguard_tickets.items()}


def _holds_its_blocks(spec: Any) -> bool:
    """Whether a request holds every block of a group with this KV cache spec while it
    runs: full attention (a window, R-SWA's gaps, a local chunk or a Mamba state free
    blocks behind it)."""
    return isinstance(spec, FullAttentionSpec) and not isinstance(spec, RSWASpec)


class GuardedSimpleCPUOffloadConnector(SimpleCPUOffloadConnector):
    """vLLM's ``SimpleCPUOffloadConnector`` whose stores pass kvguard's tier gate."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # Worker side, seals on: the sealed load events until they complete.
        self._kvguard_loads = LoadVerifier()
        manager = self.scheduler_manager
        if manager is None:
            return  # a worker, or prefix caching off (vLLM then offloads nothing)
        refuse_unsized_tier(vllm_config)
        verify = guard_config(vllm_config).seal
        if verify:
            refuse_seals_for_groups(kv_cache_config)
        manager.__class__ = GuardedSimpleCPUOffloadScheduler
        manager.kvguard_adopt(verify)

    # Worker side: each sealed load event is verified when the workers finish it.

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._kvguard_loads.expect(getattr(connector_metadata, LOAD_SEALS, None))

    def get_finished(self, finished_req_ids: set[str]) -> Any:
        finished = super().get_finished(finished_req_ids)
        loads, handler = self._kvguard_loads, self.worker_handler
        if loads.expected and handler is not None:
            pending = handler._pending_load_event_indices
            loads.verify([e for e in loads.expected if e not in pending])  # loaded
        return finished

    def get_block_ids_with_load_errors(self) -> set[int]:
        refused = self._kvguard_loads.take_refused()
        return set(super().get_block_ids_with_load_errors()) | refused

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
