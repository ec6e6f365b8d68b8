"""``GuardedLMCacheConnectorV1``: vLLM's ``LMCacheConnectorV1`` behind kvguard's exit gate.

LMCache decides while a step is being *scheduled* to save that step's KV (its
``ReqMeta.save_spec``), and its workers save it from the forward, before anyone knows
whether the step's logits are finite. This subclass keeps LMCache's code and changes
what each step's metadata asks of the workers, as a thin adapter from vLLM's hooks to
the exit gate (:mod:`.gate`):

* **Saves wait for validation.** Each save LMCache asks for is held back and issued,
  at a later step, only up to the request's validated frontier (the gate's: its
  leading blocks VALIDATED or later under this request's keys), cut at an LMCache chunk
  boundary unless it is LMCache's whole save. The KV of those blocks sits unchanged in
  the request's blocks meanwhile, so the workers save exactly the KV that validated.
  A request whose last validated blocks are still unsaved when it finishes keeps its
  blocks one step longer (``request_finished`` answers "free later"), the save goes out
  with the next step and the workers report the request done sending. A step that
  fails never reaches LMCache: the request is aborted, its pending save dropped.
* **Tickets and the tier record.** Each chunk issued opens a ticket per block and is
  recorded at once as a tier copy (under LMCache's chunk hash), with the seals of its
  blocks: the workers save it in the forward of the very step that carries it, before
  any later step can purge it. LMCache evicts without telling the scheduler, so the
  record keeps the newest chunks only (:func:`record_limit`).
* **Purges.** An invalidated hash's chunks are removed from LMCache by the workers at
  the next step (``kvguard_purge`` on the metadata, before any load of that step).
* **Loads verified by their seals** (seals on). Only the leading chunks kvguard
  recorded a seal for are offered as a hit (an LMCache copy kvguard did not save in
  this process -- another instance's, an earlier run's -- is recomputed). A load
  carries the seal of every block it fills (``kvguard_load_seals``); after LMCache's
  synchronous retrieve the worker puts back the blocks the load rewrote that vLLM
  already held (LMCache retrieves whole chunks), seals what it loaded and reports the
  blocks that differ through ``get_block_ids_with_load_errors``: vLLM's
  ``kv_load_failure_policy`` recomputes or fails the request, the rotten chunk and
  the chunks after it leave LMCache, counted (``lmcache_loads_refused``) and logged.

Refused at start-up under the guard: LMCache's layerwise mode, CacheBlend, asynchronous
loading (loads that complete outside ``start_load_kv``), its own prefill/decode
transfer (``enable_pd``: a save there is a transfer to another instance) and the
producer role (its workers then save whatever a step carries).

LMCache 0.5.6 drives vLLM up to 0.33 (its adapter reads ``resumed_req_ids``, which vLLM
0.34 dropped). Its worker side needs a CUDA (or XPU, MUSA, HPU) device: LMCache ships no
connector for CPU caches.

Without kvguard's pool underneath (stock scheduler, or the guard off) it is vLLM's
``LMCacheConnectorV1``. The plugin (``KVGUARD_GUARD=1``) substitutes it for
``kv_connector="LMCacheConnectorV1"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvguard.adapters.vllm._compat import require_supported_vllm

require_supported_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import (  # noqa: E402
    LMCacheConnectorV1,
)
from vllm.logger import init_logger  # noqa: E402

from kvguard.adapters.vllm.config import GuardConfigError, guard_config  # noqa: E402
from kvguard.adapters.vllm.exits.gate import (  # noqa: E402
    LOAD_SEALS,
    NORMAL_ENDS,
    ExitGate,
    group_key,
    refuse_seals_for_groups,
)
from kvguard.adapters.vllm.metrics import LMCACHE_COUNTERS  # noqa: E402
from kvguard.adapters.vllm.workers.seals import LoadVerifier, process_runner  # noqa: E402
from kvguard.hashing import BlockHash  # noqa: E402

if TYPE_CHECKING:
    from kvguard.adapters.vllm.pool.block_pool import GuardedBlockPool

logger = init_logger(f"vllm.{__name__}")
"""Under vLLM's logger, as the scheduler's: vLLM's handler, format and level apply."""

TIER = "lmcache"
"""The tier name kvguard records LMCache's copies under (``tier_copies``)."""

PURGE = "kvguard_purge"
"""The connector metadata's attribute with the chunk hashes the workers remove from
LMCache before the step's loads."""

FINISH_AFTER_SAVE = "kvguard_finish_after_save"
"""The connector metadata's attribute with the finished requests whose last save the
step carries: the workers report them done sending, and vLLM frees their blocks."""

_UNGATED_MODES = {
    "use_layerwise": "layerwise mode loads KV during the forward, after start_load_kv",
    "enable_blending": "CacheBlend reuses KV computed in other contexts",
    "enable_async_loading": "asynchronous loading completes loads outside start_load_kv",
    "enable_pd": "its prefill/decode mode transfers KV while the step is being saved",
}
"""LMCache settings under which kvguard cannot gate it, and why."""


@dataclass(slots=True)
class _Save:
    """A request's save LMCache asked for, issued as its blocks validate."""

    template: Any
    """LMCache's ``ReqMeta`` of the save: its tokens and slots up to :attr:`target`."""
    target: int
    """Tokens LMCache means to hold of the request."""
    saved: int
    """Tokens saved so far (LMCache's skip point)."""
    table: list[int]
    """The request's block table, as LMCache's tracker of it keeps it (appended to as
    the request runs; a new list when it resumes after a preemption)."""
    finished: bool = False
    """The request finished and keeps its blocks for this save."""


@dataclass(slots=True)
class _SealedLoad:
    meta: Any
    """LMCache's ``ReqMeta`` of the load."""
    first_block: int
    """The request's block index of the first block the load fills."""
    seals: dict[int, int | None]


def _config_of(impl: Any) -> Any:
    return getattr(impl, "config", None)


def refuse_ungated_modes(kv_transfer_config: Any) -> None:
    """Refuse an LMCache configuration kvguard cannot gate (:data:`_UNGATED_MODES`, or
    the producer role), as LMCache will read it -- its configuration (file or
    environment) under the connector's ``lmcache.*`` settings -- before LMCache starts
    its services."""
    if kv_transfer_config.kv_role == "kv_producer":
        raise GuardConfigError(
            'kvguard cannot gate LMCache with kv_role="kv_producer": its workers then save '
            "every request a step carries, whatever the scheduler asks. Use "
            '"kv_both", or run LMCache unguarded (KVGUARD_GUARD=0)'
        )
    extra = dict(kv_transfer_config.kv_connector_extra_config or {})
    config: Any = None
    for name, why in _UNGATED_MODES.items():
        value = extra.get(f"lmcache.{name}")
        if value is None:
            if config is None:
                from lmcache.integration.vllm.utils import lmcache_get_or_create_config

                config = lmcache_get_or_create_config()
            value = getattr(config, name, False)
        if str(value).strip().lower() in ("1", "true", "yes", "on"):
            raise GuardConfigError(
                f"kvguard cannot gate LMCache with {name}: {why}. Switch it off, or run "
                "LMCache unguarded (KVGUARD_GUARD=0)"
            )


class GuardedLMCacheConnectorV1(LMCacheConnectorV1):
    """vLLM's ``LMCacheConnectorV1`` whose saves pass kvguard's exit gate, and whose
    loads are verified by their seals (seals on)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        refuse_ungated_modes(vllm_config.kv_transfer_config)
        super().__init__(vllm_config, role, kv_cache_config)
        impl = self._lmcache_engine
        config = _config_of(impl)
        self._kvguard_verify = guard_config(vllm_config).seal
        if self._kvguard_verify and kv_cache_config is not None:
            refuse_seals_for_groups(kv_cache_config)
        self._kvguard_block = vllm_config.cache_config.block_size
        self._kvguard_chunk = int(getattr(config, "chunk_size", 256))
        self.kvguard_gate = ExitGate(TIER, LMCACHE_COUNTERS)
        self._kvguard_record_limit = record_limit(
            config, kv_cache_config, self._kvguard_block, self._kvguard_chunk
        )
        self._kvguard_requests: dict[str, Any] = {}
        self._kvguard_saves: dict[str, _Save] = {}
        self._kvguard_purge: list[int] = []
        self._kvguard_loads: dict[str, _SealedLoad] = {}
        self._kvguard_finishing: list[str] = []
        # LMCache's own chunk hashes (its scheduler-side token database, made when
        # LMCache made its lookup client): kvguard names each chunk it records by them.
        lookup = getattr(impl, "lookup_client", None)
        self._kvguard_tokens_db: Any = getattr(lookup, "token_database", None)
        if self._kvguard_tokens_db is None and config is not None:
            from lmcache.v1.token_database import ChunkedTokenDatabase

            self._kvguard_tokens_db = ChunkedTokenDatabase(config)
        # Worker side: the loads it verifies, and the requests it reports done.
        self.kvguard_loads = LoadVerifier()
        self._kvguard_done_sending: set[str] = set()

    # ------------------------------------------------------------------ binding

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        parent = getattr(super(), "bind_kv_cache_manager", None)
        if parent is not None:
            parent(kv_cache_manager)
        self.kvguard_gate.bind(getattr(kv_cache_manager, "block_pool", None), self._kvguard_purger)

    def kvguard_pool(self) -> GuardedBlockPool | None:
        return self.kvguard_gate.pool

    # ------------------------------------------------------------------ lookups

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        hit, asynchronous = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if self.kvguard_gate.pool is None:
            return hit, asynchronous
        self._kvguard_requests[request.request_id] = request
        if self._kvguard_verify and hit:
            hit = self._kvguard_sealed_hit(request, num_computed_tokens, hit)
        return hit, asynchronous

    def _kvguard_sealed_hit(self, request: Any, computed: int, hit: int) -> int:
        """``hit`` cut before the first block kvguard holds no seal for: a copy it did
        not save (another instance's, an earlier run's, one purged since) is
        recomputed rather than loaded and refused."""
        pool = self.kvguard_gate.pool
        assert pool is not None
        tier_seal = pool.core.tier_gate.tier_seal
        size = self._kvguard_block
        hashes = request.block_hashes
        spec = getattr(self._lmcache_engine, "load_specs", {}).get(request.request_id)
        # (LMCache's hit, before it leaves the prompt's last token to be recomputed.)
        extent = spec.lmcache_cached_tokens if spec is not None else computed + hit
        position = computed // size
        while (position + 1) * size <= extent and position < len(hashes):
            if tier_seal(group_key(hashes[position], 0), TIER) is None:
                break
            position += 1
        if position * size >= extent:
            return hit
        sealed = max(position * size - computed, 0)
        self.kvguard_gate.count("lmcache_hits_cut", 1)
        if spec is not None:
            spec.lmcache_cached_tokens = computed + sealed
        return min(sealed, hit)

    # ------------------------------------------------------------------ the step

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        if self.kvguard_gate.pool is None:
            return meta
        for req_id in scheduler_output.finished_req_ids:
            save = self._kvguard_saves.get(req_id)
            if save is None or not save.finished:
                self._kvguard_saves.pop(req_id, None)
                self._kvguard_requests.pop(req_id, None)
        self._kvguard_loads.clear()
        gate = self.kvguard_gate
        if gate.num_frontiers() > 2 * len(self._kvguard_saves) + 16:
            gate.forget_requests(self._kvguard_saves)  # (amortized: requests gone since)
        requests = list(getattr(meta, "requests", ()))
        self._kvguard_hold_back(requests)
        self._kvguard_issue(meta, {m.req_id: m for m in requests})
        if self._kvguard_verify:
            self._kvguard_expect_loads(meta, requests)
        if self._kvguard_purge:
            setattr(meta, PURGE, self._kvguard_purge)
            self._kvguard_purge = []
        if self._kvguard_finishing:
            setattr(meta, FINISH_AFTER_SAVE, self._kvguard_finishing)
            self._kvguard_finishing = []
        return meta

    def _kvguard_hold_back(self, requests: Sequence[Any]) -> None:
        """Take each save LMCache asked for this step out of the metadata: it goes out
        (:meth:`_kvguard_issue`) as far as its blocks validated."""
        saves = self._kvguard_saves
        trackers = self._lmcache_engine._request_trackers
        for m in requests:
            spec = m.save_spec
            if spec is None or not spec.can_save:
                continue
            spec.can_save = False
            save = saves.get(m.req_id)
            table = trackers[m.req_id].allocated_block_ids
            if save is None or save.table is not table:
                # A new save, or LMCache started the request again (preempted): its
                # skip point is LMCache's.
                saves[m.req_id] = _Save(m, len(m.token_ids), spec.skip_leading_tokens, table)
            elif len(m.token_ids) >= save.target:
                save.template, save.target = m, len(m.token_ids)

    def _kvguard_issue(self, meta: Any, in_meta: dict[str, Any]) -> None:
        """Issue every held save as far as its request's blocks validated."""
        gate = self.kvguard_gate
        chunk = self._kvguard_chunk
        size = self._kvguard_block
        trackers = self._lmcache_engine._request_trackers
        for req_id, save in list(self._kvguard_saves.items()):
            if save.finished:
                # A finished request keeping its blocks for this save: the workers report
                # it done (vLLM frees its blocks) whether or not the save goes out.
                self._kvguard_finishing.append(req_id)
                del self._kvguard_saves[req_id]
                request = self._kvguard_requests.pop(req_id, None)
            elif save.saved >= save.target:
                continue  # (most requests, most steps)
            else:
                request = self._kvguard_requests.get(req_id)
                tracker = trackers.get(req_id)
                if tracker is None or tracker.allocated_block_ids is not save.table:
                    del self._kvguard_saves[req_id]  # (preempted: LMCache saves it again)
                    continue
            if save.saved >= save.target or request is None:
                continue
            block_ids = save.table
            n = gate.frontier(
                req_id, 0, block_ids, request.block_hashes, size, held=not save.finished
            )
            end = min(save.target, n * size)
            if end < save.target:
                end = end // chunk * chunk
            if end <= save.saved:
                continue
            m = in_meta.get(req_id)
            if m is not None and m.load_spec is not None and m.load_spec.can_load:
                continue  # (its first step loads: nothing of it validated yet)
            chunks = self._kvguard_open(save, block_ids, end)
            if chunks is None:
                continue
            issued = dataclasses.replace(
                save.template,
                token_ids=save.template.token_ids[:end],
                slot_mapping=save.template.slot_mapping[:end],
                save_spec=type(save.template.save_spec)(save.saved, True),
                load_spec=m.load_spec if m is not None else None,
                is_last_prefill=save.template.is_last_prefill and end == save.target,
            )
            if m is not None:
                meta.requests[meta.requests.index(m)] = issued
            else:
                meta.requests.append(issued)
            save.saved = end
            gate.count("lmcache_chunks_stored", chunks)

    def _kvguard_open(self, save: _Save, block_ids: Sequence[int], end: int) -> int | None:
        """Record every chunk of the save ``[skip, end)`` as a tier copy (a ticket per
        block, acknowledged at once: the workers save it in this step's forward).
        Returns how many chunks, or None if kvguard refuses a block (nothing opened)."""
        gate = self.kvguard_gate
        size = self._kvguard_block
        chunk = self._kvguard_chunk
        first = save.saved // chunk * chunk
        copies: list[tuple[int, list[Any]]] = []
        for start, stop, chunk_hash in self._kvguard_chunks(save.template.token_ids[:end]):
            if start < first:
                continue
            tickets = gate.open_all(block_ids[start // size : -(-stop // size)])
            if isinstance(tickets, int):
                for _, opened in copies:
                    gate.fail(opened)
                return None
            copies.append((chunk_hash, tickets))
        for chunk_hash, tickets in copies:
            gate.settle(chunk_hash, tickets)
        recorded = gate.recorded()
        if len(recorded) > self._kvguard_record_limit:
            # LMCache evicts without telling the scheduler: the oldest records go.
            excess = len(recorded) - self._kvguard_record_limit
            gate.forget([copy for copy, _ in zip(recorded, range(excess), strict=False)])
        return len(copies)

    def _kvguard_chunks(self, tokens: Sequence[int]) -> Iterable[tuple[int, int, int]]:
        """LMCache's chunks of ``tokens``: (start, end, chunk hash)."""
        db: Any = self._kvguard_tokens_db
        return db.process_tokens(list(tokens), make_key=False)

    # ------------------------------------------------------------------ finishing

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        delay, params = super().request_finished(request, block_ids)
        req_id = request.request_id
        save = self._kvguard_saves.get(req_id)
        if self.kvguard_gate.pool is None or save is None:
            self._kvguard_requests.pop(req_id, None)
            return delay, params
        if request.status in NORMAL_ENDS and save.saved < save.target:
            n = self.kvguard_gate.frontier(
                req_id, 0, block_ids, request.block_hashes, self._kvguard_block, held=False
            )
            if n * self._kvguard_block > save.saved:
                save.finished = True
                save.table = list(block_ids)
                return True, params  # its last save goes out with the next step
        del self._kvguard_saves[req_id]
        self._kvguard_requests.pop(req_id, None)
        return delay, params

    # ------------------------------------------------------------------ loads

    def _kvguard_expect_loads(self, meta: Any, requests: Sequence[Any]) -> None:
        """The seal each block a load fills must give: the one kvguard recorded with
        LMCache's copy of the request's block at that position."""
        pool = self.kvguard_gate.pool
        assert pool is not None
        tier_seal = pool.core.tier_gate.tier_seal
        size = self._kvguard_block
        sealed: dict[str, dict[int, int | None]] = {}
        for m in requests:
            spec = m.load_spec
            if spec is None or not spec.can_load:
                continue
            request = self._kvguard_requests.get(m.req_id)
            hashes = request.block_hashes if request is not None else []
            first = spec.vllm_cached_tokens // size
            end = spec.lmcache_cached_tokens
            seals: dict[int, int | None] = {}
            for position in range(first, -(-end // size)):
                block_id = int(m.slot_mapping[position * size]) // size
                whole = (position + 1) * size <= end and position < len(hashes)
                seals[block_id] = tier_seal(group_key(hashes[position], 0), TIER) if whole else None
            if seals:
                sealed[m.req_id] = seals
                self._kvguard_loads[m.req_id] = _SealedLoad(m, first, seals)
        if sealed:
            setattr(meta, LOAD_SEALS, sealed)

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        invalid = connector_output.invalid_block_ids
        if not invalid or not self._kvguard_loads:
            return
        for req_id, load in list(self._kvguard_loads.items()):
            bad = [b for b in load.seals if b in invalid]
            if bad:
                del self._kvguard_loads[req_id]
                self._kvguard_refuse(req_id, load, bad)

    def _kvguard_refuse(self, req_id: str, load: _SealedLoad, bad: list[int]) -> None:
        """A load whose blocks did not verify: its rotten chunk and the chunks after it
        leave kvguard's record (the workers removed them from LMCache)."""
        blocks = list(load.seals)
        first_bad = min(blocks.index(b) for b in bad) + load.first_block
        m = load.meta
        end = m.load_spec.lmcache_cached_tokens
        cut = first_bad * self._kvguard_block // self._kvguard_chunk * self._kvguard_chunk
        rotten = [h for _, stop, h in self._kvguard_chunks(m.token_ids[:end]) if stop > cut]
        gate = self.kvguard_gate
        gate.forget(rotten)
        gate.count("lmcache_loads_refused")
        gate.count("lmcache_chunks_purged", len(rotten))
        logger.warning(
            "kvguard: request %s: %d block(s) it loaded from tier %s do not verify by "
            "their seals (the copy rotted, or is not the KV that validated); the load "
            "fails -- vLLM's kv_load_failure_policy decides whether the request recomputes "
            "or fails -- and %d chunk(s) are removed from LMCache",
            req_id,
            len(bad),
            TIER,
            len(rotten),
        )

    # ------------------------------------------------------------------ purging

    def _kvguard_purger(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """The tier's purger: every recorded chunk holding one of ``hashes`` leaves
        kvguard's record now, and LMCache when the workers run the next step."""
        gate = self.kvguard_gate
        holding = gate.copies_holding(hashes)
        if not holding:
            return []
        gate.forget(holding)
        self._kvguard_purge.extend(holding)
        gate.count("lmcache_chunks_purged", len(holding))
        return gate.purged_keys(holding.values(), hashes)

    # ------------------------------------------------------------------ worker side

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        finishing = getattr(meta, FINISH_AFTER_SAVE, None)
        if finishing:
            self._kvguard_done_sending.update(finishing)
        purge = getattr(meta, PURGE, None)
        if purge:
            remove_chunks(self._lmcache_engine, purge)
        expected = getattr(meta, LOAD_SEALS, None)
        if not expected:
            super().start_load_kv(forward_context, **kwargs)
            return
        loads = [m for m in meta.requests if m.req_id in expected]
        kept = keep_blocks(self._kvguard_held_blocks(loads))
        try:
            super().start_load_kv(forward_context, **kwargs)
        finally:
            kept()
        self.kvguard_loads.expect(expected)
        refused = self.kvguard_loads.verify(list(expected))
        for req_id, bad in refused.items():
            m = next(m for m in loads if m.req_id == req_id)
            remove_rotten(self._lmcache_engine, m, bad, self._kvguard_block)

    def _kvguard_held_blocks(self, loads: Sequence[Any]) -> list[int]:
        """Blocks a load rewrites that vLLM already held: LMCache retrieves whole chunks,
        from the chunk of vLLM's first uncached token."""
        size = self._kvguard_block
        chunk = self._kvguard_chunk
        held: list[int] = []
        for m in loads:
            cached = m.load_spec.vllm_cached_tokens
            for position in range(cached // chunk * chunk // size, cached // size):
                held.append(int(m.slot_mapping[position * size]) // size)
        return held

    def get_block_ids_with_load_errors(self) -> set[int]:
        refused = set(super().get_block_ids_with_load_errors())
        return refused | self.kvguard_loads.take_refused()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, receiving = super().get_finished(finished_req_ids)
        done = self._kvguard_done_sending & finished_req_ids
        if done:
            self._kvguard_done_sending -= done
            sending = set(sending or ()) | done
        return sending, receiving

    def kvguard_stats(self) -> dict[str, int]:
        return self.kvguard_gate.stats()


def record_limit(config: Any, kv_cache_config: Any, block_size: int, chunk_size: int) -> int:
    """How many of LMCache's chunks kvguard keeps a record of: twice what LMCache's local
    CPU and disk backends hold (at least 4096). LMCache evicts without telling the
    scheduler, so the record would otherwise grow for as long as the server runs; a
    chunk whose record went is no longer purged by an invalidation and, with seals on,
    no longer loaded (its hit is cut: recomputed)."""
    floor = 4096
    try:
        group = kv_cache_config.kv_cache_groups[0]
        chunk_bytes = group.kv_cache_spec.page_size_bytes * len(group.layer_names)
        chunk_bytes = chunk_bytes * chunk_size // block_size
        local = float(config.max_local_cpu_size or 0) + float(config.max_local_disk_size or 0)
    except (AttributeError, IndexError, TypeError):
        return floor
    if chunk_bytes <= 0:
        return floor
    return max(2 * int(local * 2**30 // chunk_bytes), floor)


# ---------------------------------------------------------------------- worker helpers


def remove_chunks(impl: Any, chunk_hashes: Iterable[int]) -> int:
    """Remove LMCache's chunks of these hashes from every storage it has; returns how
    many copies went. (LMCache's engine removes by key; the key is its chunk hash in
    this instance's model, world size, worker and dtype.)"""
    engine = getattr(impl, "lmcache_engine", None)
    if engine is None:
        return 0
    make_key = engine.token_database._make_key_by_hash
    remove = engine.storage_manager.remove
    return sum(int(remove(make_key(h)) or 0) for h in chunk_hashes)


def remove_rotten(impl: Any, m: Any, bad: Sequence[int], block_size: int) -> None:
    """Remove the chunks of load ``m`` from the first block in ``bad`` on."""
    engine = getattr(impl, "lmcache_engine", None)
    if engine is None:
        return
    end = m.load_spec.lmcache_cached_tokens
    slots = [int(s) // block_size for s in m.slot_mapping[:end:block_size]]
    cut = min(slots.index(b) for b in bad if b in slots) * block_size
    hashes = [
        h
        for _, stop, h in engine.token_database.process_tokens(
            list(m.token_ids[:end]), make_key=False
        )
        if stop > cut
    ]
    remove_chunks(impl, hashes)


def keep_blocks(block_ids: Sequence[int]) -> Any:
    """Copy these blocks of every attention cache of this worker's model runner aside;
    returns the call that puts them back."""
    runner = process_runner()
    if not block_ids or runner is None:
        return lambda: None
    import torch

    from kvguard.adapters.vllm.workers.caches import block_layouts

    index = torch.tensor(list(block_ids), dtype=torch.long)
    saved: list[tuple[Any, int, Any]] = []
    for layout in block_layouts(runner):
        dim = 1 if layout.kind.name == "FLASH_ATTN" else 0
        for cache in layout.caches:
            at = index.to(cache.device)
            saved.append((cache, dim, cache.index_select(dim, at)))

    def put_back() -> None:
        for cache, dim, blocks in saved:
            cache.index_copy_(dim, index.to(cache.device), blocks)

    return put_back
