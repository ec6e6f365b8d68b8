"""``GuardedExampleConnector``: vLLM's ``ExampleConnector`` (shared-storage KV) gated.

vLLM's ``ExampleConnector`` keeps KV in a folder per prompt on a storage path the
instances share (``shared_storage_path``; one safetensors file per layer). It decides at
schedule time (``build_connector_meta``) to store a new request's prompt when no folder
holds it, and its workers write the files from the paged cache layer by layer *during
the forward* (``save_kv_layer``) -- before the step's NaN count exists. A lookup is
``os.path.exists(folder)``, so stock vLLM serves a failed step's KV to every instance
on that storage, prefill/decode included.

This subclass keeps the workers' copy where it is made, but out of sight:

* **Staged, then committed.** Each store is written into a staging folder of its own
  (``<folder>.kvguard-<n>``), which no lookup finds. When the step's output has been
  processed (:meth:`kvguard_settle_stores`, called by the guarded scheduler after each
  output), a store whose blocks kvguard holds as VALIDATED or later, with the request's
  hash at each position, is committed: renamed into place (atomic on one filesystem),
  and recorded as a tier copy (``begin_store`` / ``ack_store``). A store with a block
  quarantined or reused meanwhile -- its step failed, or never validated -- is deleted.
  One still waiting for a step (a step without a NaN count) stays staged.
* **Loads** are what any connector loads: the blocks vLLM allocated for them are
  WRITTEN until a step of the request, computing on them, is counted clean. A folder
  whose loaded blocks are then quarantined (that step failed) is deleted: its KV may be
  what failed. One whose blocks validate is recorded as a tier copy.
* **Purged by hash**: a hash :meth:`GuardedBlockPool.invalidate
  <kvguard.adapters.vllm.pool.block_pool.GuardedBlockPool.invalidate>` taints deletes every
  folder recorded to hold it (:mod:`kvguard.adapters.vllm.exits.tier_purge`).
* **Sealed, and verified on load** (seals on: ``{"kvguard": {"seal": true}}``): a
  committed store's folder carries a digest of the prompt it holds and its blocks'
  seals (``kvguard-seals.json``, the seals taken when their step validated). A worker
  loads each request's folder on its own; the folder is refused -- a failed load,
  whose blocks vLLM's ``kv_load_failure_policy`` recomputes or fails, every other
  request proceeding -- when it cannot be read (truncated, missing, misshapen: vLLM's
  own load would kill the engine), carries no seals, or its loaded KV does not give
  them (the bytes rotted, it holds another prefix's KV, or another model, dtype or
  layout wrote it). A refused folder is deleted, counted (``storage_loads_refused``)
  and logged with the request.

kvguard gates the stores by block hashes, which vLLM computes with prefix caching on:
with it off the guarded scheduler refuses this connector at start-up. Without kvguard's
pool underneath (the guard off) it is vLLM's ``ExampleConnector``. The plugin
(``KVGUARD_GUARD=1``) substitutes it for ``kv_connector="ExampleConnector"``, also
inside a ``MultiConnector``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvguard.adapters.vllm._compat import require_supported_vllm

require_supported_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (  # noqa: E402
    ExampleConnector,
)
from vllm.logger import init_logger  # noqa: E402

from kvguard.adapters.vllm.config import GuardConfigError, guard_config  # noqa: E402
from kvguard.adapters.vllm.exits.gate import ExitGate, PendingExit, group_key  # noqa: E402
from kvguard.adapters.vllm.metrics import STORAGE_COUNTERS  # noqa: E402
from kvguard.adapters.vllm.pool.block_pool import GuardedBlockPool  # noqa: E402
from kvguard.hashing import BlockHash  # noqa: E402

logger = init_logger(f"vllm.{__name__}")
"""Under vLLM's logger, as the scheduler's: vLLM's handler, format and level apply."""

TIER = "vllm-example-storage"
"""The tier name kvguard records the connector's folders under (``tier_copies``)."""

_STAGING = ".kvguard-"
"""Marks a staging folder: ``<folder>.kvguard-<pid>-<n>`` (no lookup names it)."""

SEALS_FILE = "kvguard-seals.json"
"""In a committed folder: ``{"prefix": <hex>, "seals": [<int>, ...]}``, a digest of the
tokens (and multimodal hashes) it holds the KV of (:func:`prefix_digest`) and the seal
of each of its blocks, in order: a load verifies both, so a folder filed under another
prefix is refused even with its own seals. (Tokens, not block hashes: vLLM's hashes
are seeded per process unless ``PYTHONHASHSEED`` is set, and instances differ.)"""


def prefix_digest(token_ids: Any, mm_hashes: Sequence[str]) -> str:
    """What a folder's KV is of: a digest of its tokens and multimodal hashes."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps([list(map(int, token_ids)), list(mm_hashes)]).encode())
    return digest.hexdigest()


@dataclass(slots=True)
class _Pending:
    """A folder written by a step not validated yet: a store (``staging`` set) or a
    load, and the blocks that must validate for it (under the request's keys)."""

    request_id: str
    folder: str
    staging: str | None
    exit: PendingExit
    prefix: str
    """:func:`prefix_digest` of what the folder holds."""


class GuardedExampleConnector(ExampleConnector):
    """vLLM's ``ExampleConnector`` whose stores become visible only once validated.

    Counters (``kvguard_stats``): ``storage_stores_committed`` folders renamed into
    place after their step validated; ``storage_stores_discarded`` staged folders
    deleted (their step failed or never validated); ``storage_folders_purged`` folders
    deleted because a hash they hold was invalidated or a step computing on their KV
    failed.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        # The exit gate; its copies are folders in place, by path.
        self.kvguard_gate = ExitGate(TIER, STORAGE_COUNTERS)
        self.kvguard_counters = self.kvguard_gate.counters
        # Scheduler side: requests handed to the connector this step (their hashes).
        self._kvguard_new: dict[str, Any] = {}
        self._kvguard_pending: list[_Pending] = []
        self._kvguard_names = (f"{_STAGING}{os.getpid()}-{n}" for n in itertools.count())
        # Worker side: the staging folder of the store being written, if any; whether
        # loads are verified by their seals; blocks whose load was refused since the
        # last report (get_block_ids_with_load_errors).
        self._kvguard_into: str | None = None
        self._kvguard_verify = guard_config(vllm_config).seal
        self._kvguard_refused: set[int] = set()

    # ------------------------------------------------------------------ binding

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        super().bind_gpu_block_pool(gpu_block_pool)
        if isinstance(gpu_block_pool, GuardedBlockPool) and not gpu_block_pool.enable_caching:
            raise GuardConfigError(
                "kvguard gates ExampleConnector's stores by the block hashes vLLM "
                "computes with prefix caching: turn prefix caching on "
                "(--enable-prefix-caching), or run this connector unguarded "
                "(KVGUARD_GUARD=0)"
            )
        self.kvguard_gate.bind(gpu_block_pool, self._kvguard_purge)

    def kvguard_stats(self) -> dict[str, int]:
        return self.kvguard_gate.stats()

    # ------------------------------------------------------------------ worker side

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        # vLLM's save, one request at a time, each into the folder the scheduler chose
        # (a staging folder under the guard; vLLM's own otherwise).
        meta = self._get_connector_metadata()
        requests = meta.requests
        try:
            for request in requests:
                if request.is_store:
                    meta.requests = [request]
                    self._kvguard_into = getattr(request, "kvguard_staging", None)
                    super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        finally:
            meta.requests = requests
            self._kvguard_into = None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # vLLM's load, one request at a time: a folder that cannot be read, or (seals
        # on) does not verify, fails that request's load alone.
        meta = self._get_connector_metadata()
        requests = meta.requests
        try:
            for request in requests:
                if request.is_store:
                    continue
                meta.requests = [request]
                folder = str(
                    super()._generate_foldername_debug(request.token_ids, request.mm_hashes)
                )
                try:
                    super().start_load_kv(forward_context, **kwargs)
                    problem = self._kvguard_check_load(request, folder)
                except Exception as exc:  # a copy that cannot be read fails its load alone
                    problem = f"cannot be read ({type(exc).__name__}: {exc})"
                if problem is not None:
                    self._kvguard_refuse_load(request, folder, problem)
        finally:
            meta.requests = requests

    def _kvguard_check_load(self, request: Any, folder: str) -> str | None:
        """Why the KV just loaded for ``request`` is not the sealed KV (None: it is, or
        seals are off)."""
        if not self._kvguard_verify:
            return None
        from kvguard.adapters.vllm.workers.seals import process_runner, unsealed_blocks

        if process_runner() is None:
            return "no sealing model runner in this worker"
        try:
            with open(os.path.join(folder, SEALS_FILE)) as f:
                stored = json.load(f)
            prefix, expected = stored["prefix"], list(stored["seals"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"carries no readable seals ({type(exc).__name__})"
        block_ids = _block_ids(request.slot_mapping.tolist(), self._block_size)
        if prefix != prefix_digest(request.token_ids.tolist(), request.mm_hashes):
            return "holds the KV of another prefix"
        if len(expected) != len(block_ids):
            return f"holds seals for another number of blocks than the {len(block_ids)} loaded"
        bad_ids = set(unsealed_blocks(dict(zip(block_ids, expected, strict=True))))
        bad = [i for i, block_id in enumerate(block_ids) if block_id in bad_ids]
        if bad:
            return f"does not verify: block(s) {bad} of {len(block_ids)} differ from their seals"
        return None

    def _kvguard_refuse_load(self, request: Any, folder: str, problem: str) -> None:
        """Fail the request's load (vLLM's ``kv_load_failure_policy`` decides), and
        delete the folder: it is not the validated KV."""
        self._kvguard_refused.update(_block_ids(request.slot_mapping.tolist(), self._block_size))
        shutil.rmtree(folder, ignore_errors=True)
        logger.warning(
            "kvguard: KV loaded from %s (tier %s) %s; the load fails and the folder is deleted",
            folder,
            TIER,
            problem,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        refused, self._kvguard_refused = self._kvguard_refused, set()
        return refused | set(super().get_block_ids_with_load_errors())

    def _generate_foldername_debug(
        self, token_ids: Any, mm_hashes: list[str], create_folder: bool = False
    ) -> str:
        folder = self._kvguard_into
        if folder is None:
            return str(super()._generate_foldername_debug(token_ids, mm_hashes, create_folder))
        if create_folder:
            os.makedirs(folder, exist_ok=True)
        return folder

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # vLLM's count is the folder's tokens minus the local prefix hit: negative when
        # the hit reaches past the folder, which would make the scheduler recompute
        # tokens inside blocks the prefix cache already publishes.
        tokens, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return (tokens if tokens is None else max(tokens, 0)), load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        self._kvguard_new[request.request_id] = request

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        loading = dict(self._requests_need_load)
        meta = super().build_connector_meta(scheduler_output)
        new, self._kvguard_new = self._kvguard_new, {}
        if self.kvguard_gate.pool is None:
            return meta
        # vLLM's metadata names no request: match each entry to its request by the
        # tokens it covers (the requests it could be: loads, or new ones storing). A
        # store matching none (not expected) is left out: nothing could validate it.
        storing = [r for r in new.values() if r.request_id not in loading]
        loads = list(loading.values())
        kept = []
        for entry in meta.requests:
            request = _take_match(storing if entry.is_store else loads, entry.token_ids.tolist())
            pending = None if request is None else self._kvguard_pend(request, entry)
            if pending is not None:
                self._kvguard_pending.append(pending)
            elif entry.is_store:
                logger.warning(
                    "kvguard: a shared-storage store kvguard cannot match to its request's "
                    "block hashes is not saved"
                )
                continue
            kept.append(entry)
        meta.requests = kept
        return meta

    def _kvguard_pend(self, request: Any, entry: Any) -> _Pending | None:
        """The pending record of a metadata entry (a store gets its staging folder), or
        None if the request has no block hash for a block the entry covers."""
        block_ids = _block_ids(entry.slot_mapping.tolist(), self._block_size)
        keys = [group_key(h, 0) for h in request.block_hashes[: len(block_ids)]]
        if len(keys) < len(block_ids):
            return None
        folder = str(super()._generate_foldername_debug(entry.token_ids, entry.mm_hashes, False))
        staging = None
        if entry.is_store:
            staging = entry.kvguard_staging = f"{folder}{next(self._kvguard_names)}"
        exit_ = self.kvguard_gate.pend(block_ids, keys)
        prefix = prefix_digest(entry.token_ids.tolist(), entry.mm_hashes)
        return _Pending(request.request_id, folder, staging, exit_, prefix)

    def kvguard_settle_stores(self, connector_output: Any = None) -> None:
        """After a step's output (``connector_output``: its connector report) was
        processed: count and name the loads the workers refused, commit what
        validated, delete what failed."""
        pending = self._kvguard_pending
        gate = self.kvguard_gate
        if not pending or gate.pool is None:
            return
        invalid = getattr(connector_output, "invalid_block_ids", None)
        waiting: list[_Pending] = []
        for item in pending:
            if invalid and item.staging is None and not invalid.isdisjoint(item.exit.block_ids):
                # A load the worker refused (unreadable, or not verified by its seals):
                # it deleted the folder; the record goes, and the refusal is counted
                # and named with its request here, where the request is known.
                gate.count("storage_loads_refused")
                logger.warning(
                    "kvguard: request %s: the KV it loaded from %s (tier %s) was refused "
                    "(the worker's log says why); vLLM's kv_load_failure_policy decides "
                    "whether it recomputes or fails, and the folder is deleted",
                    item.request_id,
                    item.folder,
                    TIER,
                )
                self._kvguard_delete(item.folder)
                continue
            verdict = gate.verdict(item.exit)
            if verdict is True:
                self._kvguard_commit(item)
            elif verdict is False:
                self._kvguard_fail(item)
            else:
                waiting.append(item)
        self._kvguard_pending = waiting

    def _kvguard_commit(self, item: _Pending) -> None:
        """Every block of the folder validated: put a store's folder in place, and
        record the tier copy (a load's folder holds what the step vouched for)."""
        gate = self.kvguard_gate
        tickets = gate.open_all(item.exit.block_ids)
        if isinstance(tickets, int):  # (the verdict was just in: not expected)
            self._kvguard_fail(item)
            return
        if item.staging is not None:
            seals = [ticket.seal for ticket in tickets]
            if None not in seals:  # (a folder partly unsealed carries none)
                with open(os.path.join(item.staging, SEALS_FILE), "w") as f:
                    json.dump({"prefix": item.prefix, "seals": seals}, f)
            try:
                os.rename(item.staging, item.folder)
            except OSError:  # another store of this prompt is in place already
                gate.fail(tickets)
                self._kvguard_discard(item.staging)
                return
            gate.count("storage_stores_committed")
        elif not os.path.isdir(item.folder):
            gate.fail(tickets)
            return  # a loaded folder another request's failed step deleted meanwhile
        if not gate.settle(item.folder, tickets):  # (acknowledged at once: not expected)
            self._kvguard_delete(item.folder)

    def _kvguard_fail(self, item: _Pending) -> None:
        """A block of the folder was quarantined (or reused): its step failed, or never
        validated. A store is deleted unseen; a loaded folder, whose KV the failed
        step computed on, is deleted too (a cache miss at worst)."""
        if item.staging is not None:
            self._kvguard_discard(item.staging)
            return
        if os.path.isdir(item.folder):
            self._kvguard_delete(item.folder)
            logger.warning(
                "kvguard: request %s failed computing on KV loaded from %s; the folder is deleted",
                item.request_id,
                item.folder,
            )

    def _kvguard_discard(self, staging: str) -> None:
        shutil.rmtree(staging, ignore_errors=True)
        self.kvguard_gate.count("storage_stores_discarded")

    def _kvguard_delete(self, folder: str) -> None:
        """Delete a folder in place, and the gate's record of it."""
        shutil.rmtree(folder, ignore_errors=True)
        self.kvguard_gate.count("storage_folders_purged")
        self.kvguard_gate.forget([folder])

    def _kvguard_purge(self, hashes: Sequence[BlockHash]) -> Iterable[BlockHash]:
        """The tier's purger: delete every folder holding one of ``hashes``."""
        holding = self.kvguard_gate.copies_holding(hashes)
        held = set().union(*holding.values())
        for folder in sorted(holding):
            self._kvguard_delete(folder)
        return [h for h in hashes if h in held]


def _block_ids(slots: list[int], block_size: int) -> list[int]:
    """The blocks a store or load entry covers, in order (its slots: whole blocks)."""
    return [slot // block_size for slot in slots[::block_size]]


def _take_match(candidates: list[Any], token_ids: list[int]) -> Any:
    """Remove and return the first request whose tokens start with ``token_ids``."""
    n = len(token_ids)
    for i, request in enumerate(candidates):
        if list(request.all_token_ids[:n]) == token_ids:
            return candidates.pop(i)
    return None
