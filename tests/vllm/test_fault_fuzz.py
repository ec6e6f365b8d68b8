"""Random fault traces through the real guarded scheduler, checked against a model of
the KV bytes.

Each trace runs requests with shared prefixes through a small pool (so vLLM preempts),
chunked prefill and decode, on full-attention, sliding-window, chunked-local and R-SWA
groups and on hybrid models (a Mamba or Mamba2 state group beside full attention),
sync and async, with prefix caching on and off, optionally behind the guarded
offloading connector, the guarded SimpleCPU connector (eager or lazy, its workers
played by :class:`SimpleCpuTier`), the guarded ExampleConnector (shared storage, its
workers played by :class:`SharedStorage`) or vLLM's NixlConnector (prefill/decode,
through kvguard's request-finished gate; :class:`NixlHandoff`), and optionally with
speculative decoding (drafts that the model accepts or rejects), while outputs randomly
carry NaN counts, come back without a count, and clients abort requests (mid-step
under async). The test keeps its
own record of every KV slot: which step wrote it, for which token prefix, and what
became of that step (clean, NaN, unchecked, or dropped because its request was
preempted, aborted or finished before the output arrived). At every step it checks what
docs/design.md promises (its "Invariants" and "Inside vLLM" sections):

* every request reads, below its computed tokens, only KV of its own token prefix
  written by steps known clean (or by its own step still in flight or unchecked);
* a block handed out fresh that holds KV of a NaN or dropped step is in that step's
  ``new_block_ids_to_zero``, and a zeroed block is held by its new owner alone;
* every store job copies complete KV of clean steps, of the token prefix its block's
  hash names, and KV loaded back from the CPU tier passes the read check above;
  SimpleCPU: every block its CPU tier registers (loadable) holds exactly that, also
  once its hash was found corrupt after the fact (``invalidate``: the tier's copies
  purged, one still running never registered);
* ExampleConnector: every folder visible on the storage holds KV of clean steps for
  exactly the tokens its name covers, and every load brings only that; a staged
  folder lives while its step awaits its verdict, a loaded one whose step failed is
  deleted; NIXL: a request is handed over exactly when it ended after steps counted
  clean, and its blocks, holding KV of clean steps, stay until the send is reported;
* every block published to the prefix cache holds, in every slot, KV of clean steps
  for the token prefix its hash names, and no step writes into a published block: KV a
  step wrote at rejected draft positions (another prefix's) is never read, published
  or stored;
* kvguard's invariants and the adapter's consistency checks hold after every step,
  and when the trace ends every block but vLLM's null block is back, unreferenced.

A Mamba group's blocks hold a state, overwritten in place, not KV slots: the test keeps,
per block, the state it holds (the token prefix it is the state of, and its writer), and
runs the worker as vLLM's does (:meth:`FaultTrace.step_state`). Each step starts from
the state at the request's computed tokens and leaves the state after its last token in
the block of the block table's column for that token; in ``align`` mode (prefix caching)
it first copies the state from the column it ended at last time (at admission: the
column of the request's computed tokens -- a prefix hit's checkpoint block) into that
block, and a Mamba2 group's step also exports the state at the prompt's last
checkpoint boundary into a block of its own. The same promises hold for states: a step
starts only from the state of its own token prefix, written by steps known clean (or by
its own steps in flight or unchecked); every published state block holds the state of
exactly the prefix its key names, computed by clean steps; a block handed out fresh
that holds the state of a NaN or dropped step is zeroed first.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

import torch  # noqa: E402

# (vLLM resolves NIXL's names while a config is being built; importing its wrapper
# first keeps that from running into a half-initialised module.)
import vllm.distributed.nixl_utils  # noqa: E402, F401
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (  # noqa: E402
    MultiKVConnectorMetadata,
    MultiKVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (  # noqa: E402
    SimpleCPUOffloadConnector,
)
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvguard import BlockHash, BlockState  # noqa: E402
from kvguard.adapters.vllm.exits.example_connector import TIER as STORAGE_TIER  # noqa: E402
from kvguard.adapters.vllm.exits.example_connector import GuardedExampleConnector  # noqa: E402
from kvguard.adapters.vllm.scheduler.guarded import GuardedAsyncScheduler, GuardedScheduler  # noqa: E402

from .harness import (  # noqa: E402
    BLOCK,
    connector_output,
    finish_reasons,
    make_request,
    make_scheduler,
    make_vllm_config,
    model_output,
    ngram_speculation,
    offloading_metadata,
    transfer_config,
)

NULL = 0
TOKEN = 5  # what model_output samples for every request
SHAPES = [
    ("full",),
    ("full", "sliding"),
    ("sliding",),
    ("full", "chunked"),
    ("chunked",),
    ("full", "rswa"),
]
HYBRID_SHAPES = [("mamba", "full"), ("mamba2", "full")]
"""A Mamba state group beside full attention; ``mamba2``'s layers also export the
state at the prompt's last checkpoint boundary inside a chunk (harness.make_scheduler)."""
NO_CACHING_MAMBA_BLOCK = 1024
"""The Mamba groups' block size without prefix caching: vLLM's config gives them the
model's length (the harness's ``max_model_len``), one state block per request."""

Writer = tuple[int, str, int]
"""(step, request id, incarnation of the request) that wrote a KV slot."""
Slot = tuple[int, Writer] | None
"""What one KV slot holds: (the token prefix's id, its writer), or None (zeroed, never
written, or bytes a failed load left unknown)."""
TAINT: Writer = (-1, "taint", 0)
"""The writer of KV found corrupt after the fact (``invalidate``), as bad as a NaN step's."""
STORAGE_LAYER = "model.layers.0.self_attn.attn"
"""The one layer ExampleConnector's workers save and load (:class:`SharedStorage`)."""
STORAGE_BATCH = 512
"""``max_num_batched_tokens`` behind ExampleConnector: more than the pool's 12 blocks
hold, so every prompt fits its first step (vLLM's ExampleConnector stores a prompt from
that step only: a chunked one would be stored in part, under its whole name)."""
STAGED = ".kvguard-"
"""In the name of a folder kvguard's ExampleConnector stages (no lookup finds it)."""
HAVE_NIXL = importlib.util.find_spec("nixl") is not None


@dataclass
class KvModel:
    """What each block's slots hold, and what became of the steps that wrote them."""

    slots: dict[int, list[Slot]] = field(default_factory=dict)
    states: dict[int, tuple[int, Writer]] = field(default_factory=dict)
    """Mamba groups: the state a block holds (the token prefix's id, its writer)."""
    fate: dict[Writer, str] = field(default_factory=dict)
    """"pending", "clean", "unchecked", "nan" or "dropped"."""
    unchecked: dict[tuple[str, int], list[Writer]] = field(default_factory=dict)
    """Writers counted neither way, per request incarnation, until a step vouches."""
    incarnation: dict[str, int] = field(default_factory=dict)
    """Each request's incarnation now: a step of an earlier one still in flight or
    unchecked is as good as dropped (no output will ever vouch for it)."""

    def slot(self, block_id: int, offset: int) -> Slot:
        return self.slots.setdefault(block_id, [None] * BLOCK)[offset]

    def write(self, block_id: int, offset: int, prefix: int, writer: Writer) -> None:
        self.slots.setdefault(block_id, [None] * BLOCK)[offset] = (prefix, writer)

    def zero(self, block_id: int) -> None:
        self.slots[block_id] = [None] * BLOCK
        self.states.pop(block_id, None)

    def failed(self, w: Writer) -> bool:
        """The step failed, or never reports for its request (it left or restarted)."""
        fate = self.fate[w]
        if fate in ("nan", "dropped"):
            return True
        return fate in ("pending", "unchecked") and w[2] != self.incarnation.get(w[1], w[2])

    def poisoned(self, block_id: int) -> bool:
        """Holds KV or a state of a step that failed or never reports (must be zeroed
        on reuse)."""
        state = self.states.get(block_id)
        if state is not None and self.failed(state[1]):
            return True
        return any(s is not None and self.failed(s[1]) for s in self.slots.get(block_id, ()))


def _prefix_ids(tokens: Sequence[int], h: int = 0) -> list[int]:
    """An id per position for the token prefix ending there (the KV's identity);
    ``h``: the id of the prefix ``tokens`` follow (0: none)."""
    ids = []
    for t in tokens:
        h = hash((h, t))
        ids.append(h)
    return ids


def _accepted(drafts: Sequence[int]) -> int:
    """How many leading drafts the model accepts (it samples ``TOKEN`` every time)."""
    n = 0
    while n < len(drafts) and drafts[n] == TOKEN:
        n += 1
    return n


class FaultTrace:
    """One random trace through a guarded scheduler, checked step by step."""

    def __init__(
        self,
        groups: tuple[str, ...],
        async_scheduling: bool,
        seed: int,
        prefix_caching: bool = True,
        offload: bool = False,
        load_failure_policy: str | None = None,
        multi: bool = False,
        spec_tokens: int = 0,
        offload_outputs: bool = False,
        simple_cpu: str | None = None,
        storage: Path | None = None,
        nixl: bool = False,
    ) -> None:
        """``offload``: behind the guarded OffloadingConnector; ``simple_cpu``
        (``"eager"``, ``"lazy"``): behind the guarded SimpleCPU connector in that mode
        instead (:class:`SimpleCpuTier`); ``storage``: behind the guarded
        ExampleConnector on a shared storage in a folder of its own there
        (:class:`SharedStorage`); ``multi``: any of them inside a MultiConnector;
        ``nixl``: prefill-instance requests (``do_remote_decode``) behind vLLM's
        NixlConnector (:class:`NixlHandoff`)."""
        self.rng = rng = random.Random(seed)
        # What settle() injects, for a request's first step and for its others: a NaN
        # count (below the first rate), no count (below the second). A shared-storage
        # store or load is decided by its request's first step; a handoff by a short
        # request's few steps.
        self.fault_rates = {"first": (0.03, 0.05), "later": (0.03, 0.05)}
        if storage is not None:
            self.fault_rates["first"] = (0.12, 0.24)
        elif nixl:
            self.fault_rates = {"first": (0.08, 0.2), "later": (0.03, 0.15)}
        self.async_scheduling = async_scheduling
        # Mamba groups: their block size, and the worker's state column per request.
        self.state_groups = {g for g, kind in enumerate(groups) if kind in ("mamba", "mamba2")}
        self.state_block = BLOCK if prefix_caching else NO_CACHING_MAMBA_BLOCK
        self.state_align = prefix_caching  # vLLM's mamba_cache_mode "align", else "none"
        self.state_checkpoints = "mamba2" in groups
        self.state_col: dict[str, int] = {}
        """Request -> the block-table column its last step left its state in (the
        worker's running state index), from its admission on."""
        # A pool small enough that vLLM preempts (a local chunk alone needs few blocks).
        self.s = (
            _simple_cpu_scheduler(
                groups,
                async_scheduling=async_scheduling,
                lazy=simple_cpu == "lazy",
                multi=multi,
                # Every other trace on a CPU tier of a few blocks, which evicts.
                cpu_blocks=6 if seed % 2 else 128,
                num_blocks=22,
                max_num_seqs=8,
            )
            if simple_cpu
            else self.make_scheduler(
                spec_tokens,
                groups=groups,
                async_scheduling=async_scheduling,
                num_blocks=12 if groups == ("chunked",) or storage is not None or nixl else 22,
                max_num_seqs=8,
                prefix_caching=prefix_caching,
                **(
                    {
                        "mamba_block_size": self.state_block,
                        "mamba_cache_mode": "align" if self.state_align else "none",
                    }
                    if self.state_groups
                    else {}
                ),
                kv_transfer_config=(
                    _offloading_config(
                        load_failure_policy=load_failure_policy or "fail",
                        multi=multi,
                        # Every other trace on a CPU tier of a few chunks, which evicts.
                        cpu_bytes=1 << (14 if seed % 2 else 20),
                        outputs=offload_outputs,
                    )
                    if offload
                    else _storage_config(storage / f"seed{seed}", multi=multi)
                    if storage is not None
                    else KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")
                    if nixl
                    else None
                ),
                # ExampleConnector stores a prompt from its first step: all of it then.
                **({"max_num_batched_tokens": STORAGE_BATCH} if storage is not None else {}),
            )
        )
        self.offload = offload
        # Speculative decoding: the drafts the "worker" proposes come from a random
        # stream of their own (the rest of a trace draws as it does without drafts).
        self.spec_tokens = spec_tokens
        self.draft_rng = random.Random(f"drafts {seed}")
        self.drafts: dict[Writer, list[int]] = {}
        """Writer -> the draft tokens its step verifies (the worker's, under async)."""
        self.rejected_in_flight: dict[tuple[str, int], int] = {}
        """Request incarnation -> drafts rejected by its steps not reported yet (under
        async scheduling the worker, which knows them, writes the next steps' tokens
        that many positions before where the scheduler placed them)."""
        # Which token prefix each block hash names (learnt from the requests' hashes),
        # and the published blocks checked so far: block id -> its key then.
        self.requests: dict[str, Request] = {}
        self.hash_ids: dict[bytes, list[int]] = {}
        self.published: dict[int, Any] = {}
        # Loads fail now and then (a suffix of the job's blocks is never written).
        self.load_failures = load_failure_policy is not None
        self.invalid: dict[int, list[int]] = {}
        """Load job id -> the GPU blocks it failed to fill."""
        # The CPU tier (offloading): chunk id -> the slots a finished store copied.
        self.cpu: dict[int, list[Slot]] = {}
        self.stores: dict[int, list[tuple[int, list[Slot]]]] = {}
        """Store job id -> (CPU chunk, the slots it copies), until the job finishes."""
        self.manager = self.s.kv_cache_manager
        prefixes = [[rng.randrange(1000, 50_000) for _ in range(2 * BLOCK)] for _ in range(3)]
        self.arrivals: dict[int, list[tuple[str, list[int], int]]] = {}
        self.expected: dict[str, list[int]] = {}
        # With offloading, a second wave comes back to the prefixes after the small GPU
        # pool evicted them, and loads them from the CPU tier.
        tiered = offload or simple_cpu is not None or storage is not None
        waves = [(0, 12)] + [(40, 60)] * tiered
        prompts: list[list[int]] = []
        # The shared storage holds whole prompts: the requests come back to a few.
        stored = [_storage_prompt(rng, prefixes) for _ in range(8)] if storage else []
        for i in range(14 * len(waves)):
            if stored:
                prompt = list(rng.choice(stored))
                prompts.append(prompt)
                # (Within the prompt's last block: see SharedStorage.)
                max_tokens = rng.randrange(2, 9)
            else:
                prompt = rng.choice(prefixes)[: rng.randrange(BLOCK, 2 * BLOCK + 1)]
                prompt = prompt + [rng.randrange(1000, 50_000) for _ in range(rng.randrange(1, 50))]
                if self.state_groups and prompts and rng.random() < 0.3:
                    # A Mamba state is cached where a step ends on a block boundary (the
                    # prompt's last one, say): the same prompt again hits it.
                    prompt = list(rng.choice(prompts))
                prompts.append(prompt)
                # A prefill instance's requests are short (often one token).
                max_tokens = rng.randrange(1, 16) if nixl else rng.randrange(4, 60)
            arrival = rng.randrange(*waves[i // 14])
            self.arrivals.setdefault(arrival, []).append((f"r{i}", prompt, max_tokens))
            # With drafts, the last steps (two in flight under async) may compute past
            # the request's last output token.
            extra = 2 * (spec_tokens + 1) if spec_tokens else 0
            self.expected[f"r{i}"] = _prefix_ids(prompt + [TOKEN] * (max_tokens + extra))
        self.incarnation = dict.fromkeys(self.expected, 0)
        self.steps_uncounted: set[Writer] = set()
        """The steps whose output came back without a NaN count for their request."""
        self.kv = KvModel(incarnation=self.incarnation)
        self.tier = SimpleCpuTier(self) if simple_cpu else None
        self.storage = SharedStorage(self) if storage is not None else None
        self.nixl = NixlHandoff(self) if nixl else None
        self.finished: set[str] = set()
        self.ended: dict[str, str] = {}
        """Request -> the finish reason of its output (clients' aborts have none)."""
        self.preempted: set[str] = set()
        self.seen = {
            "nan": 0,
            "unchecked": 0,
            "aborted": 0,
            "preempted": 0,
            "hit_tokens": 0,
            "stored": 0,
            "loaded": 0,
            "load_failures": 0,
            "drafts_accepted": 0,
            "drafts_rejected": 0,
            "state_reads": 0,
            "state_hits": 0,
            "state_copies": 0,
            "state_checkpoints": 0,
            "states_published": 0,
            "states_zeroed": 0,
            "tainted": 0,
            "storage_stores": 0,
            "storage_loads": 0,
            "storage_failed_loads": 0,
            "handoffs": 0,
            "handoffs_vouched": 0,
            "withheld": 0,
        }

    @staticmethod
    def make_scheduler(spec_tokens: int, **options: Any) -> Any:
        """The guarded scheduler; with ``spec_tokens``, with speculative decoding
        (n-gram drafts: vLLM's "ngram" under sync scheduling, "ngram_gpu" under async,
        which "ngram" refuses), which the guard takes only where the workers count NaNs
        per request (the test's ``per_request_nans`` fixture)."""
        if not spec_tokens:
            return make_scheduler(**options)
        config = ngram_speculation(spec_tokens, async_scheduling=options["async_scheduling"])
        return make_scheduler(speculative_config=config, **options)

    def run(self) -> dict[str, int]:
        s = self.s
        pending: list[tuple[Any, dict[str, Writer]]] = []
        for t in range(400):
            for req_id, prompt, max_tokens in self.arrivals.get(t, ()):
                request = self.requests[req_id] = make_request(req_id, prompt, max_tokens)
                if self.nixl is not None:
                    request.kv_transfer_params = {"do_remote_decode": True}
                s.add_request(request)
            pending.append(self.schedule(t))
            if self.async_scheduling:
                self.abort()  # mid-step: the request's step is in flight
                if len(pending) == 2:
                    self.settle(*pending.pop(0))
            else:
                so, writers = pending.pop(0)
                self.settle(so, writers)
                if self.spec_tokens:
                    self.propose_drafts(so)
                self.abort()  # between steps, after a clean or failed output
            if self.tier is not None:
                self.tier.taint()
            s.kvguard_pool.check_consistency()
            if t > max(self.arrivals) and not s.requests and not pending and not self.tier_busy():
                break
        while pending:
            self.settle(*pending.pop(0))
        if self.tier is not None:
            self.tier.drain()
        assert not s.requests, "the trace did not drain"
        assert self.finished == set(self.expected)
        core = s.kvguard_pool.core
        held = [b.block_id for b in core.block_records if b.ref_cnt]
        assert held == [NULL], f"blocks still referenced after the trace: {held}"
        by_state = core.stats().blocks_by_state
        assert by_state[BlockState.WRITTEN] == 0
        assert by_state[BlockState.ALLOCATED] == 1  # the null block
        s.kvguard_pool.check_consistency()
        self.check_nothing_outlives_the_requests()
        if self.seen["stored"]:  # the connector's counters reach the scheduler's stats
            stats = s.kvguard_stats()
            assert stats["offload_chunks_stored"] > 0
            self.seen["evicted"] = stats["offload_chunks_evicted"]
            self.seen["discarded"] = stats["offload_chunks_discarded"]
        if self.storage is not None:
            stats = s.kvguard_stats()
            assert stats["storage_stores_committed"] == self.seen["storage_stores"]
            self.seen["discarded"] = stats["storage_stores_discarded"]
            self.seen["purged"] = stats["storage_folders_purged"]
        return self.seen

    def tier_busy(self) -> bool:
        """SimpleCPU: a copy is queued, in flight or not reported yet."""
        return self.tier is not None and self.tier.busy()

    def check_nothing_outlives_the_requests(self) -> None:
        """The guard's per-request and per-step bookkeeping is empty once every request
        left, and its record of tier copies names only chunks the CPU tier holds: no
        record grows with the requests a server has seen."""
        s = self.s
        pool = s.kvguard_pool
        assert s._kvguard_ledger.is_empty()
        assert not (pool.pending or pool.held_events or pool.take_cached() or pool.take_copies())
        assert not s._kvguard_clean and not s._kvguard_unchecked
        recorded = 0
        for connector in s._kvguard_connectors():
            cs: Any = getattr(connector, "connector_scheduler", None)
            gate = getattr(cs, "kvguard_gate", None)
            stored = gate.recorded() if gate is not None else {}
            probe = ReqContext(req_id="probe")
            for key, hashes in stored.items():
                assert cs.manager.lookup(key, probe) is LookupResult.HIT, key
                recorded += len(hashes)
        if self.tier is not None:
            recorded += self.tier.check_nothing_left()
            self.tier.check_nothing_held_back()
        elif self.storage is not None:
            recorded += self.storage.check_nothing_left()
        assert len(pool.core.snapshot().tier_copies) <= recorded

    def retire(self, req_id: str) -> None:
        """The request's steps in flight will never report for it (it left or restarts)."""
        self.incarnation[req_id] += 1

    def schedule(self, t: int) -> tuple[Any, dict[str, Writer]]:
        s, manager = self.s, self.manager
        tables_before = {r: manager.get_block_ids(r) for r in s.requests}
        so = s.schedule()
        for req_id in so.preempted_req_ids:
            self.seen["preempted"] += 1
            self.preempted.add(req_id)
            self.retire(req_id)
        zeroed = set(so.new_block_ids_to_zero or ())
        self.check_zeroed_blocks_have_one_owner(zeroed)
        # (Copy-on-write copies come only with partial-block prefix hits, which these
        # traces do not run: the model would have to copy them.)
        assert not getattr(so, "kv_cache_block_copies", None), "a CoW copy the model ignores"
        starts = self.worker_starts(so)
        admitted = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):  # (vLLM 0.33 sends resumed ones here)
            if req_id in getattr(cached, "resumed_req_ids", ()):
                admitted[req_id] = cached.num_computed_tokens[i]
        for req_id, computed in admitted.items():
            # The worker seeds a new (or resumed) request's state column from its
            # computed tokens: -1, a fresh state; else the prefix hit's block.
            self.state_col[req_id] = (computed - 1) // self.state_block
        reads = []
        for req_id, n in so.num_scheduled_tokens.items():
            start = s.requests[req_id].num_computed_tokens - n
            old = tables_before.get(req_id, ())
            for g, blocks in enumerate(manager.get_block_ids(req_id)):
                size = self.state_block if g in self.state_groups else BLOCK
                fresh = [
                    b
                    for i, b in enumerate(blocks)
                    if b != NULL and i * size >= start and not (old and b in old[g])
                ]
                for b in fresh:  # handed out for this step to write into
                    assert b in zeroed or not self.kv.poisoned(b), (
                        f"block {b} reused unzeroed with failed KV (or Mamba state)"
                    )
                if g not in self.state_groups:  # (a state is read in step_state)
                    reads.append((req_id, blocks, starts[req_id]))
            if start > 0 and not any(old):
                self.seen["hit_tokens"] += start  # a prefix hit at admission or resumption
        for b in zeroed:
            if b in self.kv.states and self.kv.poisoned(b):
                self.seen["states_zeroed"] += 1
            self.kv.zero(b)
        if self.offload:
            self.transfer(so)
        elif self.tier is not None:
            self.tier.load(so)  # (before the forward)
        elif self.storage is not None:
            self.storage.load(so)  # (before the forward, into blocks the step reads)
        # The reads, after the zeroing and the loads: ExampleConnector loads into blocks
        # its request's step reads.
        for args in reads:
            self.check_reads(*args)
        self.check_published()
        writers: dict[str, Writer] = {}
        hashed = [b.block_hash is not None for b in s.kvguard_pool.blocks]
        for req_id, n in so.num_scheduled_tokens.items():
            start = starts[req_id]
            w = writers[req_id] = (t, req_id, self.incarnation[req_id])
            self.kv.fate[w] = "pending"
            ids = self.expected[req_id][start : start + n]
            assert len(ids) == n, f"{req_id} computes past its last token"
            drafts = self.step_drafts(so, w)
            if drafts:
                # The KV at each draft's position is that of the tokens before it plus
                # the drafts so far: the expected prefix's while the drafts match what
                # the model samples, another prefix's from the first wrong one on.
                known = n - len(drafts)
                ids[known:] = _prefix_ids(drafts, ids[known - 1])
                key = (req_id, w[2])
                rejected = len(drafts) - _accepted(drafts)
                self.rejected_in_flight[key] = self.rejected_in_flight.get(key, 0) + rejected
            for g, blocks in enumerate(manager.get_block_ids(req_id)):
                if g in self.state_groups:
                    self.step_state(req_id, g, blocks, start, n, w, hashed)
                    continue
                for p, prefix in enumerate(ids, start):
                    b = blocks[p // BLOCK]
                    assert b != NULL and not hashed[b], (
                        f"{req_id}'s step writes position {p} into block {b}, "
                        + ("the null block" if b == NULL else "published")
                    )
                    self.kv.write(b, p % BLOCK, prefix, w)
        if self.tier is not None:
            self.tier.send_stores(so)  # (after the forward: wait_for_save)
        elif self.storage is not None:
            self.storage.save(so, writers)  # (during the forward: save_kv_layer)
        return so, writers

    def step_state(
        self,
        req_id: str,
        group: int,
        blocks: list[int],
        start: int,
        n: int,
        w: Writer,
        hashed: list[bool],
    ) -> None:
        """What the worker does with a Mamba group's state for the step computing
        tokens ``start..start+n`` of ``req_id`` (``blocks``: the group's block table).

        vLLM's worker keeps per request the column of the block its state is in (seeded
        at admission, :meth:`schedule`). In ``align`` mode, before the forward, it copies
        the state from that column into the block of the column of the step's last
        token, ``cdiv(end, block) - 1``, if that is another
        (``preprocess_mamba_align_fused_kernel`` / ``precopy_mamba_align_fused_kernel``);
        the step starts from the state there -- or from a fresh state at token 0
        (``has_initial_states``) -- and leaves its final state there. A Mamba2 group also
        exports the state at the prompt's checkpoint boundary into the block vLLM
        reserved for it (``compute_mamba_prefill_checkpoints``). Without prefix caching
        (``none``) the one block of the request holds the state, read and written in
        place."""
        kv, ids = self.kv, self.expected[req_id]
        size, end = self.state_block, start + n
        col = -(-end // size) - 1
        target = blocks[col]
        assert target != NULL, f"{req_id}'s state for {end} tokens goes to the null block"
        src = self.state_col[req_id]
        if self.state_align and src >= 0 and src != col:
            source = blocks[src]
            assert source != NULL, (
                f"{req_id}'s state at column {src} was freed before its step copied it"
            )
            held = kv.states.get(source)
            if held is None:
                kv.states.pop(target, None)
            else:
                kv.states[target] = held
            self.seen["state_copies"] += 1
        if start > 0:
            self.check_state_read(req_id, target, start)
        elif src >= 0:
            raise AssertionError(f"{req_id} starts afresh with a state column {src}")
        if self.state_checkpoints and self.state_align:
            position = self.checkpoint_position(group, end, n)
            if position:
                b = blocks[-(-end // size) - 2]
                if b != NULL:
                    assert not hashed[b], f"{req_id}'s checkpoint goes to published block {b}"
                    kv.states[b] = (ids[position - 1], w)
                    self.seen["state_checkpoints"] += 1
        assert not hashed[target], f"{req_id}'s step writes its state into published block {target}"
        kv.states[target] = (ids[end - 1], w)
        self.state_col[req_id] = col

    def check_state_read(self, req_id: str, block_id: int, computed: int) -> None:
        """The step starts from the state of its own prefix of ``computed`` tokens,
        written by a step known clean, or by its own (same incarnation) step still in
        flight or unchecked."""
        held = self.kv.states.get(block_id)
        assert held is not None, f"{req_id} starts from an empty state (block {block_id})"
        prefix, w = held
        assert prefix == self.expected[req_id][computed - 1], (
            f"{req_id} starts at {computed} from another prefix's state (block {block_id})"
        )
        fate = self.kv.fate[w]
        own = w[1] == req_id and w[2] == self.incarnation[req_id]
        assert fate == "clean" or (own and fate in ("pending", "unchecked")), (
            f"{req_id} starts at {computed} from the state of a step that is {fate} ({w})"
        )
        self.seen["state_reads"] += 1
        if w[1] != req_id:
            self.seen["state_hits"] += 1  # another request's published state

    def checkpoint_position(self, group: int, end: int, n: int) -> int:
        """Where the worker exports a Mamba2 checkpoint in a step ending at ``end``
        after ``n`` tokens (0: none): vLLM's own rule, as its backends call it."""
        from vllm.model_executor.layers.mamba.checkpoint import (
            compute_mamba_prefill_checkpoints,
        )

        manager = self.manager.coordinator.single_type_managers[group]
        spec = manager.kv_cache_spec
        pool = self.s.kvguard_pool
        lookahead: dict[
            str, int
        ] = {}  # (vLLM 0.33 and later: 0.32's pool hashes no lookahead tokens)
        if (
            "num_hash_lookahead_tokens"
            in inspect.signature(compute_mamba_prefill_checkpoints).parameters
        ):
            lookahead["num_hash_lookahead_tokens"] = pool.num_hash_lookahead_tokens
        (offset,), _ = compute_mamba_prefill_checkpoints(
            [end],
            [n],
            hash_block_size=pool.hash_block_size,
            mamba_block_size=spec.block_size,
            checkpoint_alignment=spec.prefill_checkpoint_alignment,
            drop_eagle_block=False,
            cache_hit_alignment_tokens=manager.cache_hit_alignment_tokens,
            **lookahead,
        )
        return end - n + offset if offset else 0

    def worker_starts(self, so: Any) -> dict[str, int]:
        """Where the worker writes each scheduled request's tokens: from its computed
        tokens, less (under async scheduling) the drafts that its steps the worker ran
        but whose output the scheduler has not seen yet rejected."""
        s, rejected = self.s, self.rejected_in_flight
        return {
            r: s.requests[r].num_computed_tokens - n - rejected.get((r, self.incarnation[r]), 0)
            for r, n in so.num_scheduled_tokens.items()
        }

    def step_drafts(self, so: Any, w: Writer) -> list[int]:
        """The draft tokens the step verifies for the request: those the scheduler sent
        (proposed by :meth:`propose_drafts`), or under async scheduling, where the
        scheduler sends placeholders, the worker's own."""
        drafts = list(so.scheduled_spec_decode_tokens.get(w[1], ()))
        if drafts and self.async_scheduling:
            drafts = [self.draft() for _ in drafts]
        if drafts:
            self.drafts[w] = drafts
        return drafts

    def draft(self) -> int:
        """A draft token: what the model samples, more often than not."""
        rng = self.draft_rng
        return TOKEN if rng.random() < 0.6 else rng.randrange(1000, 50_000)

    def propose_drafts(self, so: Any) -> None:
        """Sync scheduling: after the step's output, the worker's drafts (0 to
        ``spec_tokens`` of them) for the requests it ran that decode next, which the
        engine hands to the scheduler for their next step."""
        s = self.s
        req_ids, drafts = [], []
        for req_id in so.num_scheduled_tokens:
            request = s.requests.get(req_id)
            if request is not None and not request.is_finished() and not request.is_prefill_chunk:
                req_ids.append(req_id)
                length = self.draft_rng.randint(0, self.spec_tokens)
                drafts.append([self.draft() for _ in range(length)])
        if req_ids:
            s.update_draft_token_ids(DraftTokenIds(req_ids, drafts))

    def check_published(self) -> None:
        """Every block published since the last check holds, in every slot, KV of steps
        known clean for the token prefix its key names."""
        published = self.published
        for block in self.s.kvguard_pool.blocks:
            b, key = block.block_id, block.block_hash
            if key is None:
                published.pop(b, None)  # (checked afresh if published again)
                continue
            if published.get(b) == key:
                continue
            published[b] = key
            ids = self.hash_prefix_ids(get_block_hash(key))
            if get_group_id(key) in self.state_groups:
                self.check_published_state(b, ids[-1])
                continue
            for offset, slot in enumerate(self.kv.slots.get(b, [None] * BLOCK)):
                assert slot is not None, f"published block {b} has an empty slot {offset}"
                assert slot[0] == ids[offset], f"published block {b} holds another prefix's KV"
                fate = self.kv.fate[slot[1]]
                assert fate == "clean", f"published block {b} holds KV of a {fate} step"

    def check_published_state(self, block_id: int, prefix: int) -> None:
        """A published Mamba block holds the state of exactly the prefix its key names
        (the one ending at the key's boundary), computed by steps known clean."""
        held = self.kv.states.get(block_id)
        assert held is not None, f"published state block {block_id} holds no state"
        assert held[0] == prefix, f"published state block {block_id} holds another prefix's state"
        fate = self.kv.fate[held[1]]
        assert fate == "clean", f"published state block {block_id} holds the state of a {fate} step"
        self.seen["states_published"] += 1

    def block_prefix_ids(self, req_id: str, block_id: int) -> list[int] | None:
        """The prefix ids of the tokens a block holds for a request: those its key
        names if it is published, else those of its place in the request's block
        table; None if neither says (a window dropped it from the table before it
        was published)."""
        key = self.s.kvguard_pool.blocks[block_id].block_hash
        if key is not None:
            return self.hash_prefix_ids(get_block_hash(key))
        if req_id in self.s.requests:
            for blocks in self.manager.get_block_ids(req_id):
                if block_id in blocks:
                    i = blocks.index(block_id)
                    return self.expected[req_id][i * BLOCK : (i + 1) * BLOCK]
        return None

    def hash_prefix_ids(self, block_hash: bytes) -> list[int]:
        """The prefix ids of the block of tokens a (vLLM) block hash names."""
        ids = self.hash_ids.get(block_hash)
        if ids is None:
            for req_id, request in self.requests.items():
                expected = self.expected[req_id]
                for i, h in enumerate(request.block_hashes):
                    self.hash_ids.setdefault(h, expected[i * BLOCK : (i + 1) * BLOCK])
            ids = self.hash_ids[block_hash]
        return ids

    def transfer(self, so: Any) -> None:
        """The workers' copies for this step: each store job's source blocks must hold
        complete KV of steps known clean (the offload gate), of the token prefix the
        request's block holds there; each load job writes what the CPU tier holds into
        its GPU blocks."""
        meta = offloading_metadata(so)
        for job_id, job in meta.store_jobs.items():
            src = [int(b) for b in job.src_spec.block_ids]
            dst = [int(c) for c in job.dst_spec.block_ids]
            snapshot = []
            for b, c in zip(src, dst, strict=True):
                slots = self.kv.slots.get(b, [None] * BLOCK)
                ids = self.block_prefix_ids(job.req_id, b)
                for offset, slot in enumerate(slots):
                    assert slot is not None, f"a store job copies block {b}, not full"
                    fate = self.kv.fate[slot[1]]
                    assert fate == "clean", f"a store job copies block {b} of a {fate} step"
                    assert ids is None or slot[0] == ids[offset], (
                        f"a store job copies block {b} holding another prefix's KV"
                    )
                snapshot.append((c, list(slots)))
            self.stores[job_id] = snapshot
        for job_id, job in meta.load_jobs.items():
            src = [int(c) for c in job.src_spec.block_ids]
            dst = [int(b) for b in job.dst_spec.block_ids]
            cut = len(dst)
            if self.load_failures and self.rng.random() < 0.5:
                cut = self.rng.randrange(len(dst))
                self.invalid[job_id] = dst[cut:]
                self.seen["load_failures"] += 1
            for c, b in zip(src[:cut], dst[:cut], strict=True):
                assert c in self.cpu, f"a load job reads CPU chunk {c}, never stored"
                self.kv.slots[b] = list(self.cpu[c])
            for b in dst[cut:]:
                self.kv.zero(b)  # unknown bytes: never to be read
            self.seen["loaded"] += cut

    def transfers_done(self, so: Any) -> tuple[list[int], list[str], list[int]]:
        """The workers finish every job of the step with its output (the blocks of
        failed loads reported invalid)."""
        meta = offloading_metadata(so)
        for job_id in meta.store_jobs:
            snapshot = self.stores.pop(job_id)
            self.cpu.update(snapshot)
            self.seen["stored"] += len(snapshot)
        done = [*meta.store_jobs, *meta.load_jobs]
        invalid = [b for job_id in meta.load_jobs for b in self.invalid.pop(job_id, ())]
        return done, [job.req_id for job in meta.load_jobs.values()], invalid

    def check_zeroed_blocks_have_one_owner(self, zeroed: set[int]) -> None:
        owners: dict[int, set[str]] = {}
        for req_id, request in self.s.requests.items():
            if not request.is_finished():
                for blocks in self.manager.get_block_ids(req_id):
                    for b in blocks:
                        owners.setdefault(b, set()).add(req_id)
        for b in zeroed:
            assert len(owners.get(b, ())) == 1, f"zeroed block {b} is shared: {owners.get(b)}"

    def check_reads(self, req_id: str, blocks: list[int], computed: int) -> None:
        """The step attends to its computed tokens' KV: its own prefix's, from steps
        known clean, or its own (same incarnation) still in flight or unchecked."""
        ids = self.expected[req_id]
        inc = self.incarnation[req_id]
        for p in range(computed):
            b = blocks[p // BLOCK]
            if b == NULL:
                continue  # out of the window / local chunk
            held = self.kv.slot(b, p % BLOCK)
            assert held is not None, f"{req_id} reads empty slot {p} (block {b})"
            prefix, w = held
            assert prefix == ids[p], f"{req_id} reads another prefix's KV at {p}"
            fate = self.kv.fate[w]
            own = w[1] == req_id and w[2] == inc
            assert fate == "clean" or (own and fate in ("pending", "unchecked")), (
                f"{req_id} reads KV at {p} of a step that is {fate} ({w})"
            )

    def settle(self, so: Any, writers: dict[str, Writer]) -> None:
        """The step's output arrives, some requests' rows NaN, some without a count."""
        s, kv, rng = self.s, self.kv, self.rng
        nans: dict[str, int] = {}
        uncounted = []
        first = {new.req_id for new in so.scheduled_new_reqs}
        for req_id in so.num_scheduled_tokens:
            if req_id in s.requests and not s.requests[req_id].is_finished():
                nan_rate, uncounted_rate = self.fault_rates["first" if req_id in first else "later"]
                roll = rng.random()
                if roll < nan_rate:
                    nans[req_id] = 1
                elif roll < uncounted_rate:
                    uncounted.append(req_id)
        if self.offload:
            completed, received, invalid = self.transfers_done(so)
            output = connector_output(
                s, so, nans, completed=completed, recved=received, invalid=invalid
            )
        elif self.tier is not None:
            output = self.tier.output(so, nans)
        elif self.nixl is not None:
            output = self.nixl.output(so, nans)
        else:
            output = model_output(s, so, nans)
        for req_id in uncounted:
            del output.num_nans_in_logits[req_id]
        live = {r: w[2] == self.incarnation[r] for r, w in writers.items()}
        if self.spec_tokens:
            self.sample(output, writers, live)
        outputs = s.update_from_output(so, output)
        reasons = finish_reasons(outputs)
        self.seen["nan"] += len(nans)
        self.seen["unchecked"] += len(uncounted)
        for req_id, w in writers.items():
            key = (req_id, w[2])
            if not live[req_id]:
                fate = "dropped"  # preempted, aborted or finished while in flight
            elif req_id in nans:
                fate = "nan"
                assert reasons.get(req_id) == "error", f"{req_id}'s NaN step did not abort it"
            elif req_id in uncounted:
                fate = "unchecked"
                self.steps_uncounted.add(w)
                kv.unchecked.setdefault(key, []).append(w)
            else:
                fate = "clean"
                for earlier in kv.unchecked.pop(key, ()):  # a counted step vouches
                    kv.fate[earlier] = "clean"
            kv.fate[w] = fate
        if self.nixl is not None:
            self.nixl.check_finished(outputs)  # (the finished ones not retired yet)
        self.ended.update(reasons)
        for req_id in reasons:
            self.finished.add(req_id)
            self.retire(req_id)
        for req_id, inc in list(kv.unchecked):
            if inc != self.incarnation[req_id]:
                for w in kv.unchecked.pop((req_id, inc)):
                    kv.fate[w] = "dropped"  # left before a counted step vouched
        self.check_published()
        if self.tier is not None:
            self.tier.check_registered()
        elif self.storage is not None:
            self.storage.check(so, writers)
        elif self.nixl is not None:
            self.nixl.check_sent()

    def sample(self, output: Any, writers: dict[str, Writer], live: dict[str, bool]) -> None:
        """The step's rows under speculative decoding, as the worker returns them: a
        step that samples (``model_output`` gave it a token) returns the drafts it
        accepted and a bonus token (the model samples ``TOKEN`` every time). The drafts a
        step rejected are no longer ahead of the scheduler's count of the request's
        computed tokens."""
        rows = output.sampled_token_ids
        for req_id, w in writers.items():
            drafts = self.drafts.pop(w, [])
            accepted = _accepted(drafts)
            index = output.req_ids.index(req_id)
            if rows[index]:
                rows[index] = [TOKEN] * (accepted + 1)
            if drafts:
                key = (req_id, w[2])
                left = self.rejected_in_flight.pop(key, 0) - (len(drafts) - accepted)
                if left:
                    self.rejected_in_flight[key] = left
                if live[req_id]:
                    self.seen["drafts_accepted"] += accepted
                    self.seen["drafts_rejected"] += len(drafts) - accepted

    def abort(self) -> None:
        """Now and then a client aborts a running request."""
        s = self.s
        running = sorted(r for r, req in s.requests.items() if not req.is_finished())
        if running and self.rng.random() < 0.05:
            victim = self.rng.choice(running)
            s.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            self.seen["aborted"] += 1
            self.finished.add(victim)
            self.retire(victim)


class SimpleCpuTier:
    """SimpleCPU's workers and the bytes of its CPU tier, played by a trace.

    SimpleCPU's scheduler side decides every copy; its workers carry out each step's
    lists (``SimpleCPUOffloadMetadata``): the load event's copies land in their GPU
    blocks before the step's forward, and its requests are reported received in the
    step's output; the store event's copies run after the forward (``wait_for_save``)
    and are reported done in the step's output or, now and then, a few outputs later
    (the copy still running, its GPU blocks pinned). A copy is modelled when it is
    reported: the CPU block gets what its GPU block holds then, so a block tainted
    (:meth:`taint`) while its copy runs hands the CPU tier its tainted KV, which the
    gate must not register.

    It checks that every store event copies complete KV of clean steps, of the token
    prefix its block's hash names; that every block the CPU tier registers (its prefix
    cache: loadable) holds exactly that, for the hash it is registered under; that a
    load reads only such blocks (then the read checks of the trace apply to what it
    brought back); and, when the trace ends, that the connector holds nothing: no
    transfer, pin or request state left, kvguard's record of the tier's copies naming
    only what the tier holds -- and, in eager mode, that the gate held no validated
    block back for good (:meth:`check_nothing_held_back`)."""

    def __init__(self, trace: FaultTrace) -> None:
        self.trace = trace
        (connector,) = [
            c for c in trace.s._kvguard_connectors() if isinstance(c, SimpleCPUOffloadConnector)
        ]
        self.manager: Any = connector.scheduler_manager
        self.cpu: dict[int, list[Slot]] = {}
        """CPU block -> the slots the last copy into it wrote."""
        self.sent: dict[int, tuple[int, list[tuple[int, int]]]] = {}
        """Store event -> (the output it is reported in at the earliest, by index; its
        (GPU block, CPU block) pairs), until it is reported."""
        self.registered: dict[int, Any] = {}
        """CPU block -> the hash it was checked under (checked afresh when it changes)."""
        self.scheduled = self.settled = 0
        self.draining = False
        self.tainted: set[Any] = set()
        self.loaded_into: dict[int, Any] = {}
        """GPU block -> the hash of the CPU copy last loaded into it."""
        trace.kv.fate[TAINT] = "nan"

    def meta(self, so: Any) -> Any:
        meta = so.kv_connector_metadata
        return meta.metadata[0] if isinstance(meta, MultiKVConnectorMetadata) else meta

    def load(self, so: Any) -> None:
        """The step's load event: each CPU block it reads is registered and holds KV of
        clean steps for its hash; its bytes land in the GPU block."""
        meta = self.meta(so)
        if meta.load_event < 0:
            return
        cpu_blocks = self.manager.cpu_block_pool.blocks
        for c, b in zip(meta.load_cpu_blocks, meta.load_gpu_blocks, strict=True):
            key = cpu_blocks[c].block_hash
            assert key is not None, f"a load reads CPU block {c}, which the tier does not hold"
            self.check_copy(c, key, "a load reads")
            self.trace.kv.slots[b] = list(self.cpu[c])
            self.loaded_into[b] = key
            self.trace.seen["loaded"] += 1

    def send_stores(self, so: Any) -> None:
        """The step's store event, after the gate: each GPU block holds complete KV of
        clean steps for the prefix its hash names. Reported with this step's output, or
        (one in five) up to three outputs later."""
        trace = self.trace
        index, self.scheduled = self.scheduled, self.scheduled + 1
        meta = self.meta(so)
        if meta.store_event < 0:
            return
        blocks = trace.s.kvguard_pool.blocks
        pairs = list(zip(meta.store_gpu_blocks, meta.store_cpu_blocks, strict=True))
        for b, _ in pairs:
            key = blocks[b].block_hash
            assert key is not None, f"a store event copies block {b}, which has no hash"
            ids = trace.hash_prefix_ids(get_block_hash(key))
            for offset, slot in enumerate(trace.kv.slots.get(b, [None] * BLOCK)):
                assert slot is not None, f"a store event copies block {b}, not full"
                fate = trace.kv.fate[slot[1]]
                assert fate == "clean", f"a store event copies block {b} of a {fate} step"
                assert slot[0] == ids[offset], f"a store event copies block {b}: another prefix"
        hold = trace.rng.randint(1, 3) if trace.rng.random() < 0.2 else 0
        self.sent[meta.store_event] = (index + hold, pairs)

    def output(self, so: Any, nans: dict[str, int]) -> Any:
        """The step's output with the workers' report: the store events due (copied
        now), the requests of the step's load event still loading."""
        trace = self.trace
        index, self.settled = self.settled, self.settled + 1
        done = [e for e, (due, _) in self.sent.items() if due <= index or self.draining]
        for event in done:
            _, pairs = self.sent.pop(event)
            for b, c in pairs:
                self.cpu[c] = list(trace.kv.slots.get(b, [None] * BLOCK))
            trace.seen["stored"] += len(pairs)
        meta = self.meta(so)
        loading = {r for r, st in self.manager._reqs_to_load.items() if st.load_event is not None}
        recved = set(meta.load_event_to_reqs.get(meta.load_event, ())) & loading
        out = model_output(trace.s, so, nans)
        worker_meta: Any = SimpleCPUOffloadWorkerMetadata(
            completed_store_events=dict.fromkeys(done, 1)
        )
        if isinstance(so.kv_connector_metadata, MultiKVConnectorMetadata):
            worker_meta = MultiKVConnectorWorkerMetadata(metadata=(worker_meta,))
        out.kv_connector_output = KVConnectorOutput(
            finished_recving=recved or None, kv_connector_worker_meta=worker_meta
        )
        return out

    def check_copy(self, c: int, key: Any, what: str) -> None:
        """CPU block ``c`` holds, in every slot, KV of clean steps for the token prefix
        ``key`` names."""
        slots = self.cpu.get(c)
        assert slots is not None, f"{what} CPU block {c}, never copied to"
        ids = self.trace.hash_prefix_ids(get_block_hash(key))
        for offset, slot in enumerate(slots):
            assert slot is not None, f"{what} CPU block {c}, not full"
            assert slot[0] == ids[offset], f"{what} CPU block {c}, holding another prefix's KV"
            fate = self.trace.kv.fate[slot[1]]
            assert fate == "clean", f"{what} CPU block {c}, holding KV of a {fate} step"

    def check_registered(self) -> None:
        """Every block the CPU tier registered since the last check holds KV of clean
        steps for its hash."""
        registered = self.registered
        for block in self.manager.cpu_block_pool.blocks:
            c, key = block.block_id, block.block_hash
            if key is None:
                registered.pop(c, None)
            elif registered.get(c) != key:
                registered[c] = key
                self.check_copy(c, key, "the CPU tier registers")

    def taint(self) -> None:
        """Now and then KV is found corrupt after the fact: a hash whose block is being
        copied (or, rarely, a cached one) is invalidated (the pool's ``invalidate``, not
        its descendants): its GPU blocks are quarantined and its copies purged from the
        CPU tier. Its KV is bad in every copy, the CPU tier's included: none may stay
        registered, nor be registered when a copy running now finishes. Only a hash no
        live request holds (the invalidation aborts a holder, which these traces do not
        model) nor computes on a copy of, loaded from the tier (such a block carries no
        hash until a step vouches for it: the invalidation does not reach it)."""
        trace = self.trace
        s, rng = trace.s, trace.rng
        pool = s.kvguard_pool
        blocks = pool.blocks
        held: set[Any] = set()
        for req_id in s.requests:
            for group in trace.manager.get_block_ids(req_id):
                for b in group:
                    held.update((blocks[b].block_hash, self.loaded_into.get(b)))
        copying = {b for _, pairs in self.sent.values() for b, _ in pairs}
        copying.update(b for t in self.manager._pending_finished_stores for b in t.gpu_block_ids)
        candidates = sorted(
            b
            for b in copying
            if blocks[b].block_hash is not None and blocks[b].block_hash not in held
        )
        if not (candidates and rng.random() < 0.3):
            candidates = [
                b.block_id
                for b in blocks
                if b.block_hash is not None and b.ref_cnt == 0 and b.block_hash not in held
            ]
            if not (candidates and rng.random() < 0.03):
                return
        key = blocks[rng.choice(candidates)].block_hash
        carriers = [b.block_id for b in blocks if b.block_hash == key]
        copies = [b.block_id for b in self.manager.cpu_block_pool.blocks if b.block_hash == key]
        pool.invalidate([BlockHash(key)], descendants=False)
        self.tainted.add(key)
        for b in carriers:
            assert blocks[b].block_hash is None, f"block {b} keeps an invalidated hash"
            slots = trace.kv.slots.get(b, [None] * BLOCK)
            trace.kv.slots[b] = [None if x is None else (x[0], TAINT) for x in slots]
        for c in copies:
            self.cpu[c] = [None if x is None else (x[0], TAINT) for x in self.cpu[c]]
            self.registered.pop(c, None)  # (checked again, now)
        self.check_registered()
        trace.seen["tainted"] += 1

    def busy(self) -> bool:
        return bool(self.sent) or self.manager.has_pending_stores()

    def check_nothing_held_back(self) -> None:
        """Eager mode, one full-attention group, a tier that never evicted: the gate
        holds a block back until its step validated, not for good (vLLM's cursor, which
        finds it unhashed on kvguard's pool until then, would pass over it). Every full
        prompt block of a request that ran to its end, never preempted, none of its
        hashes tainted, is in the CPU tier."""
        m, trace = self.manager, self.trace
        if m._lazy_mode or len(m.group_block_sizes) > 1:
            return
        if trace.s.kvguard_stats()["offload_chunks_evicted"]:
            return
        lookup = m.cpu_block_pool.cached_block_hash_to_block.get_one_block
        missing: dict[str, list[int]] = {}
        for req_id, reason in trace.ended.items():
            if reason not in ("length", "stop") or req_id in trace.preempted:
                continue
            request = trace.requests[req_id]
            full = request.num_prompt_tokens // BLOCK
            keys = [make_block_hash_with_group_id(h, 0) for h in request.block_hashes[:full]]
            if self.tainted.intersection(keys):
                continue
            absent = [i for i, key in enumerate(keys) if lookup(key) is None]
            if absent:
                missing[req_id] = absent
        assert not missing, f"prompt blocks never stored (request -> block indices): {missing}"

    def drain(self) -> None:
        """After the trace: empty steps, every copy reported at once, until none is
        queued or in flight (lazy mode may copy again at each step: one suffices)."""
        self.draining = True
        for t in range(1000, 1010):
            if not self.busy():
                return
            self.trace.settle(*self.trace.schedule(t))
        raise AssertionError(f"copies still in flight: {self.sent}")

    def check_nothing_left(self) -> int:
        """The connector's state once the trace ended: no transfer, pin or request left;
        kvguard's record of the tier's copies names only blocks the tier holds. Returns
        how many copies it records."""
        m = self.manager
        assert not self.sent and not m.has_pending_stores() and not m.kvguard_in_flight()
        left = {
            "loads": m._reqs_to_load,
            "load events": m._load_event_to_reqs,
            "stores": m._reqs_to_store,
            "store events": m._store_event_to_reqs,
            "blocks in flight": m._in_flight_store_gpu_blocks,
            "CPU hits pinned": m._pending_cpu_hits,
        }
        assert not any(left.values()), {k: v for k, v in left.items() if v}
        cpu_pool = m.cpu_block_pool
        pinned = [b.block_id for b in cpu_pool.blocks if b.ref_cnt and not b.is_null]
        assert not pinned, f"CPU blocks still referenced after the trace: {pinned}"
        recorded = m.kvguard_gate.recorded()  # CPU block -> the key it holds
        for cpu_block_id, keys in recorded.items():
            held = cpu_pool.blocks[cpu_block_id].block_hash
            assert keys == (held,), f"kvguard records a copy the tier dropped: {keys!r}"
        return len(recorded)


class SharedStorage:
    """vLLM's ExampleConnector's workers and its shared storage, played by a trace.

    The workers are kvguard's ``GuardedExampleConnector`` in the worker role, run as
    vLLM's model runner runs them: each step's connector metadata bound, its real
    ``start_load_kv`` before the forward and its real ``save_kv_layer`` after the
    step's writes (one layer, :data:`STORAGE_LAYER`). Their KV tensor carries, per
    slot, the id of the token prefix and a code for the step that wrote it, so every
    file on the storage says whose KV it holds; what a load writes lands in the
    trace's model of the KV slots, and the read checks apply to it.

    vLLM's connector names a folder by the tokens it holds: a prompt's full blocks but
    the one holding its last token. The prompts here are a few blocks and 2 to 6
    tokens (:func:`_storage_prompt`): with one token over, vLLM's store (which keeps
    every full block) and its lookup (which drops the last token first) name different
    folders. Outputs stay within the prompt's last block (at most 8 tokens), so no
    request needs a block after its first step, and none is preempted: vLLM 0.32 and
    0.33 load a resumed request's KV from the folder its prompt and outputs name
    together, and vLLM's lookup reports a negative hit for a resumed request whose
    cached blocks reach past its prompt's folder.

    Checked after every output: every folder in place (no ``.kvguard-`` in its name)
    holds, for exactly the tokens its name covers, KV of steps known clean; every
    load reads a folder in place, holding the same; a folder whose loading step had
    NaN is gone; a staged folder whose verdict is in -- a step of its KV failed, or
    its request left -- is gone after the next output at the latest (kvguard settles
    the stores before vLLM releases the requests an output finishes, which validates
    or quarantines their blocks). When the trace ends: no staged folder is left,
    nothing pending in the connector, and kvguard's record of the tier's copies names
    folders in place only.
    """

    def __init__(self, trace: FaultTrace) -> None:
        self.trace = trace
        s = trace.s
        (self.connector,) = [
            c for c in s._kvguard_connectors() if isinstance(c, GuardedExampleConnector)
        ]
        self.path = Path(self.connector._storage_path)
        self.path.mkdir(parents=True, exist_ok=True)
        # (Inside a MultiConnector, with the config vLLM gives the child: its storage.)
        self.worker = GuardedExampleConnector(
            self.connector._vllm_config, KVConnectorRole.WORKER, s.kv_cache_config
        )
        self.kv = torch.zeros(s.kv_cache_config.num_blocks, 1, BLOCK, 2, dtype=torch.int64)
        """The workers' KV cache: per slot (token prefix id, writer code; 0: none)."""
        self.writers: list[Writer] = []
        self.codes: dict[Writer, int] = {}
        self.names: dict[str, list[int]] = {}
        """Folder name -> the prefix ids of the tokens it is named by."""
        for arrivals in trace.arrivals.values():
            for _, prompt, _ in arrivals:
                tokens = prompt[: (len(prompt) - 1) // BLOCK * BLOCK]
                folder = self.worker._generate_foldername_debug(torch.tensor(tokens), [])
                self.names[os.path.basename(folder)] = _prefix_ids(tokens)
        self.checked: dict[str, tuple[int, int]] = {}
        """Folder in place -> (inode, ctime) when it was checked (a new commit differs)."""
        self.loads: dict[int, list[tuple[str, str]]] = {}
        """Scheduler output (by id) -> the (folder, request) of each of its loads."""
        self.staged: dict[str, list[str]] = {}
        """Staging folder -> the request whose step stored it (or those it could be)."""
        self.outputs = 0
        self.verdicts: dict[str, int] = {}
        """Staging folder -> the output (by index) after which its verdict was in."""

    def meta(self, so: Any) -> Any:
        meta = so.kv_connector_metadata
        return meta.metadata[0] if isinstance(meta, MultiKVConnectorMetadata) else meta

    def code(self, slot: Slot) -> list[int]:
        if slot is None:
            return [0, 0]
        code = self.codes.get(slot[1])
        if code is None:
            self.writers.append(slot[1])
            code = self.codes[slot[1]] = len(self.writers)
        return [slot[0], code]

    def slot(self, row: Sequence[int]) -> Slot:
        return None if row[1] == 0 else (row[0], self.writers[row[1] - 1])

    def load(self, so: Any) -> None:
        """Before the forward: the step's metadata bound, and its loads run (each reads a
        folder in place, holding KV of clean steps for its tokens)."""
        trace = self.trace
        meta = self.meta(so)
        self.worker.bind_connector_metadata(meta)
        loads = [entry for entry in meta.requests if not entry.is_store]
        if not loads:
            return
        tables = {r: trace.manager.get_block_ids(r)[0] for r in so.num_scheduled_tokens}
        for entry in loads:
            folder = self.worker._generate_foldername_debug(entry.token_ids, entry.mm_hashes)
            self.check_folder(folder, "a load reads")
            ids = [int(x) // BLOCK for x in entry.slot_mapping[::BLOCK]]
            (req_id,) = [r for r, table in tables.items() if table[: len(ids)] == ids]
            self.loads.setdefault(id(so), []).append((folder, req_id))
        layer = SimpleNamespace(kv_cache=self.kv)
        self.worker.start_load_kv(
            SimpleNamespace(
                no_compile_layers={STORAGE_LAYER: layer}, attn_metadata={STORAGE_LAYER: object()}
            )
        )
        for entry in loads:
            for x in entry.slot_mapping.tolist():
                b, offset = divmod(x, BLOCK)
                trace.kv.slots.setdefault(b, [None] * BLOCK)[offset] = self.slot(
                    self.kv[b, 0, offset].tolist()
                )
        trace.seen["storage_loads"] += len(loads)

    def save(self, so: Any, writers: dict[str, Writer]) -> None:
        """After the step's writes: its stores (kvguard's worker writes each into its
        staging folder); the metadata is released."""
        trace = self.trace
        for new in so.scheduled_new_reqs:
            assert new.num_computed_tokens + so.num_scheduled_tokens[new.req_id] >= len(
                new.prompt_token_ids
            ), f"{new.req_id}'s prompt does not fit its first step: raise STORAGE_BATCH"
        stores = [entry for entry in self.meta(so).requests if entry.is_store]
        for entry in stores:
            ids = [x // BLOCK for x in entry.slot_mapping[::BLOCK].tolist()]
            # (Requests whose blocks are all shared -- prefix hits -- store the same.)
            self.staged[os.path.basename(entry.kvguard_staging)] = [
                r for r in writers if trace.manager.get_block_ids(r)[0][: len(ids)] == ids
            ]
        if stores:
            blocks = {x // BLOCK for entry in stores for x in entry.slot_mapping.tolist()}
            for b in sorted(blocks):
                slots = trace.kv.slots.get(b, [None] * BLOCK)
                self.kv[b, 0] = torch.tensor([self.code(slot) for slot in slots])
            self.worker.save_kv_layer(STORAGE_LAYER, self.kv, attn_metadata=object())
        self.worker.clear_connector_metadata()

    def read(self, folder: str, what: str) -> list[Slot]:
        """The slots of the folder's one file, as the workers wrote them."""
        name = os.path.basename(folder)
        files = os.listdir(folder)
        assert files == [f"{STORAGE_LAYER}.safetensors"], f"{what} folder {name}: {files}"
        kv = _load_safetensors(os.path.join(folder, files[0]))["kv_cache"]
        return [self.slot(row) for row in kv[:, 0].tolist()]

    def check_folder(self, folder: str, what: str) -> bool:
        """A folder in place holds, for exactly the tokens its name covers, KV of steps
        known clean. Returns whether it was not checked before as it is now."""
        name = os.path.basename(folder)
        ids = self.names.get(name)
        assert ids is not None, f"{what} folder {name}, which no prompt of the trace names"
        assert os.path.isdir(folder), f"{what} folder {name}, which is not on the storage"
        stat = os.stat(folder)
        key = (stat.st_ino, stat.st_ctime_ns)
        if self.checked.get(name) == key:
            return False
        slots = self.read(folder, what)
        assert len(slots) == len(ids), (
            f"{what} folder {name} holding {len(slots)} tokens' KV; its name covers {len(ids)}"
        )
        fates = self.trace.kv.fate
        for p, slot in enumerate(slots):
            assert slot is not None, f"{what} folder {name}, without KV at {p}"
            assert slot[0] == ids[p], f"{what} folder {name}, holding another prefix's KV at {p}"
            fate = fates[slot[1]]
            assert fate == "clean", f"{what} folder {name}, holding KV of a {fate} step at {p}"
        self.checked[name] = key
        return True

    def check(self, so: Any, writers: dict[str, Writer]) -> None:
        """After the step's output: its failed loads' folders are gone; every folder in
        place holds KV of clean steps; a staged one goes by the output after its
        verdict is in."""
        trace = self.trace
        for folder, req_id in self.loads.pop(id(so), ()):
            if trace.kv.fate[writers[req_id]] == "nan":
                assert not os.path.exists(folder), (
                    f"{req_id}'s step failed computing on KV loaded from "
                    f"{os.path.basename(folder)}, which stays on the storage"
                )
                trace.seen["storage_failed_loads"] += 1
        for name in sorted(os.listdir(self.path)):
            folder = os.path.join(self.path, name)
            if STAGED not in name:
                if self.check_folder(folder, "the storage holds"):
                    trace.seen["storage_stores"] += 1
                continue
            staged = {slot[1] for slot in self.read(folder, "the storage stages") if slot}
            failed = sorted(w for w in staged if trace.kv.failed(w))
            requests = [trace.s.requests.get(r) for r in self.staged[name]]
            if failed or all(r is None or r.is_finished() for r in requests):
                # The verdict is in: its step failed, or its request left (its blocks
                # validated or quarantined as they were released).
                since = self.verdicts.setdefault(name, self.outputs)
                assert since == self.outputs, (
                    f"staged folder {name} outlives its verdict ({failed or 'clean'}, "
                    f"request {self.staged[name]}) by {self.outputs - since} output(s)"
                )
            # (All its KV clean, its request running: kvguard vouches for a step without
            # a NaN count by the request's next step scheduled after that output, a step
            # or so after this model does.)
        self.outputs += 1

    def check_nothing_left(self) -> int:
        """The trace ended: no folder staged, nothing pending in the connector, kvguard's
        record of the tier's copies naming folders in place only. Returns how many
        hashes it records copies of."""
        staged = sorted(n for n in os.listdir(self.path) if STAGED in n)
        assert not staged, f"staged folders left after the trace: {staged}"
        assert not self.loads
        c = self.connector
        left = {
            "pending": c._kvguard_pending,
            "new": c._kvguard_new,
            "loads": c._requests_need_load,
        }
        assert not any(left.values()), {k: v for k, v in left.items() if v}
        recorded = c.kvguard_gate.recorded()
        for folder in recorded:
            assert os.path.isdir(folder) and STAGED not in folder, f"{folder} recorded, gone"
        held = c.kvguard_gate.held_keys()
        assert set(held) == {h for hashes in recorded.values() for h in hashes}
        core = self.trace.s.kvguard_pool.core
        for block_hash, tiers in core.snapshot().tier_copies:
            if STORAGE_TIER in tiers:
                assert block_hash in held, f"a tier copy of no folder: {block_hash!r}"
        return len(held)


class NixlHandoff:
    """NIXL's workers on a prefill instance, played by a trace (vLLM's real
    NixlConnector scheduler side): every request carries ``do_remote_decode``, so each
    that ends normally is offered to the connector, which -- if it is handed over --
    returns transfer parameters for the client and keeps the request's blocks until
    the workers report the decode instance read them (``finished_sending``). The
    workers report that one to three outputs after the request finished.

    Checked for each finished request, against the trace's own record of what it
    injected: it is handed over (its output carries transfer parameters) exactly when
    it ended normally after steps all counted clean -- each counted clean, or without
    a count but vouched for by a later step of its own counted clean (kvguard's rule),
    none with NaN, none in flight; the blocks of a handed-over one hold KV of clean
    steps for its tokens, and stay held (not freed, not written) until its send is
    reported, then are freed; a withheld one's blocks are freed at once."""

    def __init__(self, trace: FaultTrace) -> None:
        self.trace = trace
        self.settled = 0
        self.sending: dict[str, tuple[int, list[int]]] = {}
        """Request handed over -> (the output its send is reported in, by index; its
        blocks of the full-attention group), until then."""
        self.reported: set[str] = set()

    def held(self, req_id: str) -> bool:
        """vLLM keeps the finished request's blocks for the connector."""
        managers = self.trace.manager.coordinator.single_type_managers
        return any(req_id in manager.req_to_blocks for manager in managers)

    def output(self, so: Any, nans: dict[str, int]) -> Any:
        """The step's output, with the sends due reported finished; what the decode
        instance read is checked first."""
        index, self.settled = self.settled, self.settled + 1
        self.reported = {r for r, (due, _) in self.sending.items() if due <= index}
        for req_id in sorted(self.reported):
            self.check_handed_kv(req_id, "was read")
        out = model_output(self.trace.s, so, nans)
        out.kv_connector_output = KVConnectorOutput(finished_sending=self.reported or None)
        return out

    def check_handed_kv(self, req_id: str, what: str) -> None:
        trace = self.trace
        _, blocks = self.sending[req_id]
        assert self.held(req_id), f"{req_id} was handed over, but its blocks are freed"
        assert trace.manager.get_block_ids(req_id)[0] == blocks
        ids = trace.expected[req_id]
        for p in range(trace.s.requests[req_id].num_computed_tokens):
            slot = trace.kv.slot(blocks[p // BLOCK], p % BLOCK)
            assert slot is not None and slot[0] == ids[p], (
                f"{req_id}'s KV {what} without its own prefix's KV at {p}"
            )
            fate = trace.kv.fate[slot[1]]
            assert fate == "clean", f"{req_id}'s KV {what} with KV of a {fate} step at {p}"

    def check_finished(self, outputs: dict[int, Any]) -> None:
        """The requests finished by this output: handed over exactly when clean."""
        trace = self.trace
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finish_reason is None:
                    continue
                req_id, inc = o.request_id, trace.incarnation[o.request_id]
                steps = [w for w in trace.kv.fate if w[1] == req_id and w[2] == inc]
                fates = sorted(trace.kv.fate[w] for w in steps)
                normal = str(o.finish_reason) in ("length", "stop")
                clean = normal and set(fates) == {"clean"}
                if not clean:
                    assert o.kv_transfer_params is None, (
                        f"{req_id} is handed over, after steps {fates} ({o.finish_reason})"
                    )
                    assert not self.held(req_id), f"{req_id}'s blocks are held, not handed over"
                    trace.seen["withheld"] += normal
                    continue
                params = o.kv_transfer_params
                assert params is not None and params.get("remote_block_ids"), (
                    f"{req_id} ended after clean, counted steps, and is not handed over"
                )
                due = self.settled + trace.rng.randint(0, 2)
                self.sending[req_id] = (due, trace.manager.get_block_ids(req_id)[0])
                self.check_handed_kv(req_id, "is handed over")
                trace.seen["handoffs"] += 1
                # (A step without a count, vouched for by a later one counted clean.)
                trace.seen["handoffs_vouched"] += not trace.steps_uncounted.isdisjoint(steps)

    def check_sent(self) -> None:
        """After an output: the requests reported sent are gone, blocks freed; those
        not yet keep their blocks."""
        s = self.trace.s
        for req_id in self.reported:
            del self.sending[req_id]
            assert req_id not in s.requests and not self.held(req_id), (
                f"{req_id} was reported sent, and vLLM still holds it"
            )
        self.reported = set()
        for req_id in self.sending:
            assert req_id in s.requests and self.held(req_id), f"{req_id} freed before sent"


def _storage_prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    """A prompt for the shared storage: 2 to 4 full blocks, a shared prefix's start
    among them, and 2 to 6 tokens more (:class:`SharedStorage`)."""
    length = BLOCK * rng.randrange(2, 5) + rng.randrange(2, 7)
    prompt = rng.choice(prefixes)[: rng.randrange(BLOCK, 2 * BLOCK + 1)]
    return prompt + [rng.randrange(1000, 50_000) for _ in range(length - len(prompt))]


def _storage_config(path: Path, *, multi: bool) -> KVTransferConfig:
    """kvguard's ExampleConnector on a shared storage at ``path`` (``multi``: inside
    vLLM's ``MultiConnector``)."""
    child = {
        "kv_connector": "GuardedExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": "kvguard.adapters.vllm",
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }
    if multi:
        return KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"connectors": [child]},
        )
    return KVTransferConfig(**child)


def _load_safetensors(path: str) -> dict[str, Any]:
    """A safetensors file's tensors (the package is vLLM's, not the lint venv's)."""
    return importlib.import_module("safetensors.torch").load_file(path)


def _simple_cpu_scheduler(
    groups: tuple[str, ...],
    *,
    async_scheduling: bool,
    lazy: bool,
    multi: bool,
    cpu_blocks: int,
    num_blocks: int,
    max_num_seqs: int,
) -> Any:
    """The guarded scheduler behind kvguard's SimpleCPU connector (named directly, so
    given its tier's size, ``num_cpu_blocks``: vLLM 0.32 sizes it from the bytes,
    which say the same), inside a ``MultiConnector`` with ``multi``. Its KV cache
    config describes a tensor per layer, which SimpleCPU sizes its tier from (the
    harness's ``make_scheduler`` describes none): ``full`` and ``sliding`` groups,
    the harness's (a 3-block window)."""
    shape: dict[str, Any] = {
        "block_size": BLOCK,
        "num_kv_heads": 1,
        "head_size": 1,
        "dtype": torch.float32,
    }
    kinds = {"full": FullAttentionSpec, "sliding": SlidingWindowSpec}
    specs = [
        kinds[kind](**shape, **({"sliding_window": 3 * BLOCK} if kind == "sliding" else {}))
        for kind in groups
    ]
    pages = [spec.page_size_bytes for spec in specs]
    child = {
        "kv_connector": "GuardedSimpleCPUOffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": "kvguard.adapters.vllm.exits.simple_cpu",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": sum(pages) * cpu_blocks,
            "num_cpu_blocks": cpu_blocks,
            "lazy_offload": lazy,
        },
    }
    transfer = (
        KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"connectors": [child]},
        )
        if multi
        else KVTransferConfig(**child)
    )
    vllm_config = make_vllm_config(
        async_scheduling=async_scheduling,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        kv_transfer_config=transfer,
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * num_blocks,
                layers=[f"layer{g}"],
                layer_stride=page * num_blocks,
                block_stride=page,
            )
            for g, page in enumerate(pages)
        ],
        kv_cache_groups=[KVCacheGroupSpec([f"layer{g}"], spec) for g, spec in enumerate(specs)],
    )
    cls = GuardedAsyncScheduler if async_scheduling else GuardedScheduler
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
        log_stats=True,
    )


def _offloading_config(*, outputs: bool, **options: Any) -> Any:
    """The offloading connector's config; ``outputs``: it stores the blocks of
    generated tokens too, not only the prompt's (vLLM's ``offload_prompt_only``)."""
    config = transfer_config(**options)
    if outputs:
        extra = config.kv_connector_extra_config
        children = extra.get("connectors")  # inside a MultiConnector
        for child in [c["kv_connector_extra_config"] for c in children] if children else [extra]:
            child["offload_prompt_only"] = False
    return config


def _run_traces(
    seeds: int, groups: tuple[str, ...], async_scheduling: bool, **options: Any
) -> dict[str, int]:
    """Run ``seeds`` traces of one configuration; what they saw, summed."""
    totals: dict[str, int] = {}
    for seed in range(seeds):
        for key, value in FaultTrace(groups, async_scheduling, seed, **options).run().items():
            totals[key] = totals.get(key, 0) + value
    return totals


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("groups", SHAPES, ids=["+".join(g) for g in SHAPES])
def test_random_fault_traces_keep_every_promise(
    groups: tuple[str, ...], async_scheduling: bool, prefix_caching: bool
) -> None:
    totals = _run_traces(4, groups, async_scheduling, prefix_caching=prefix_caching)
    # The traces exercised what they are for.
    assert totals["nan"] > 0 and totals["unchecked"] > 0 and totals["preempted"] > 0
    assert totals["aborted"] > 0
    assert (totals["hit_tokens"] > 0) == prefix_caching


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["align", "none"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("groups", HYBRID_SHAPES, ids=["+".join(g) for g in HYBRID_SHAPES])
def test_random_fault_traces_on_hybrid_models_keep_every_promise(
    groups: tuple[str, ...], async_scheduling: bool, prefix_caching: bool
) -> None:
    """The same traces on a hybrid model: a Mamba (or Mamba2) state group beside full
    attention, with prefix caching (vLLM's ``align`` mode: a state block per block
    boundary, published once its step validated) and without (``none``: one state
    block per request). Besides the attention checks, every step starts from a state of
    its own prefix by clean steps (or its own in flight), every published state block
    holds exactly the state its key names, and a fresh block holding a failed step's
    state is zeroed.

    Not run on hybrids: offloading (kvguard holds a Mamba state back when vLLM offers
    it to a connector, ``boundary_state_offloads``, so no state reaches the CPU tier --
    docs/vllm-reference.md's limits -- and the attention half is what the offloading traces
    check), and speculative decoding (Mamba groups take drafts only through the
    model's speculative state blocks, ``num_speculative_blocks``, with MTP/EAGLE
    drafters whose accepted-token state copies the worker makes after the step:
    neither the n-gram drafts these traces use nor the model here has them)."""
    if "mamba2" in groups:  # the worker's checkpoint rule, which the model runs
        pytest.importorskip("vllm.model_executor.layers.mamba.checkpoint")
    totals = _run_traces(8, groups, async_scheduling, prefix_caching=prefix_caching)
    assert totals["nan"] > 0 and totals["unchecked"] > 0 and totals["preempted"] > 0
    assert totals["aborted"] > 0 and totals["state_reads"] > 0
    assert (totals["hit_tokens"] > 0) == prefix_caching
    if prefix_caching:
        # Requests start from states other requests computed, published states were
        # checked, and the worker copied states between blocks.
        assert totals["state_hits"] > 0 and totals["states_published"] > 0
        assert totals["state_copies"] > 0
        assert (totals["state_checkpoints"] > 0) == ("mamba2" in groups)
    else:
        assert totals["state_hits"] == totals["states_published"] == 0
    assert totals["states_zeroed"] > 0  # failed steps' states were zeroed before reuse


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("groups", SHAPES, ids=["+".join(g) for g in SHAPES])
def test_random_fault_traces_with_the_guarded_offloading_connector(
    groups: tuple[str, ...], async_scheduling: bool
) -> None:
    """The same traces with vLLM's CPU offloading behind kvguard's gate: every store
    job copies complete KV of clean steps, and what later loads back from the CPU tier
    (the small GPU pool evicts) passes the same read checks."""
    _offloading_traces(groups, async_scheduling, multi=False)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("groups", [("full",), ("full", "sliding")], ids=["full", "full+sliding"])
def test_random_fault_traces_with_the_connector_inside_a_multi_connector(
    groups: tuple[str, ...], async_scheduling: bool
) -> None:
    """The guarded offloading connector as a child of vLLM's ``MultiConnector``."""
    _offloading_traces(groups, async_scheduling, multi=True)


def _offloading_traces(groups: tuple[str, ...], async_scheduling: bool, multi: bool) -> None:
    totals = _run_traces(3, groups, async_scheduling, offload=True, multi=multi)
    assert totals["nan"] > 0 and totals["preempted"] > 0 and totals["aborted"] > 0
    assert totals["stored"] > 0 and totals["loaded"] > 0 and totals["evicted"] > 0


SIMPLE_CPU_SHAPES = [("full",), ("full", "sliding")]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mode", ["eager", "lazy"])
@pytest.mark.parametrize("groups", SIMPLE_CPU_SHAPES, ids=["+".join(g) for g in SIMPLE_CPU_SHAPES])
def test_random_fault_traces_with_the_guarded_simple_cpu_connector(
    groups: tuple[str, ...], mode: str, async_scheduling: bool
) -> None:
    """The same traces behind kvguard's SimpleCPU connector (vLLM's
    SimpleCPUOffloadConnector, gated), eager and lazy, its workers played by
    :class:`SimpleCpuTier`; now and then a hash is found corrupt while its block is
    being copied. Every store event copies complete KV of clean steps; every block
    the CPU tier registers holds exactly the KV of clean steps for its hash (a copy
    that finished after its block was invalidated is not registered); what loads back
    passes the read checks; nothing is left in the connector when the trace ends; in
    eager mode no validated prompt block is held back for good.

    The gate mutated, traces fail: with ``GuardedSimpleCPUOffloadScheduler.
    _kvguard_acknowledge`` accepting every ticket, every configuration (a copy that
    finished after its block was invalidated reaches vLLM's
    ``_process_store_completion``, which asserts on the block's missing hash); with
    ``_kvguard_admit`` skipped, every configuration too (that, or a tainted copy left
    registered: unrecorded, it is not purged); with ``_kvguard_validated_prefix``
    returning the lists uncut, the async eager one (vLLM's cursor passes over a block
    still being validated: a clean prompt block is never stored)."""
    _simple_cpu_traces(groups, async_scheduling, mode, multi=False)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_random_fault_traces_with_the_simple_cpu_connector_inside_a_multi_connector(
    mode: str, async_scheduling: bool
) -> None:
    """kvguard's SimpleCPU connector as a child of vLLM's ``MultiConnector``."""
    _simple_cpu_traces(("full",), async_scheduling, mode, multi=True)


def _simple_cpu_traces(
    groups: tuple[str, ...], async_scheduling: bool, mode: str, multi: bool
) -> None:
    totals = _run_traces(6, groups, async_scheduling, simple_cpu=mode, multi=multi)
    assert totals["nan"] > 0 and totals["preempted"] > 0 and totals["aborted"] > 0
    assert totals["stored"] > 0 and totals["loaded"] > 0 and totals["evicted"] > 0
    assert totals["tainted"] > 0 and totals["discarded"] > 0


@pytest.mark.parametrize("multi", [False, True], ids=["alone", "multi"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_random_fault_traces_with_the_guarded_example_connector(
    async_scheduling: bool, multi: bool, tmp_path: Path
) -> None:
    """The same traces behind kvguard's ExampleConnector (vLLM's shared-storage
    connector, gated) on a ``tmp_path`` storage, its workers played by
    :class:`SharedStorage`: full attention (vLLM's connector stores group 0 only),
    prefix caching on (kvguard gates the stores by block hashes), a batch that holds
    every prompt whole (:data:`STORAGE_BATCH`: vLLM's connector stores a prompt from
    its first step only), and requests that come back to a few prompts, to load them
    from the storage once the small pool evicted them. A request's first step, which
    stores or loads, fails more often. Every folder in place holds KV of clean steps
    for exactly the tokens its name covers; every load brings only such KV (and then
    passes the read checks); a staged folder outlives its verdict by one output at
    most (kvguard settles the stores before vLLM releases the requests the output
    finishes); a folder whose loading step had NaN is deleted; nothing is left
    staged or pending when the trace ends. No request is preempted: outputs stay
    within the prompt's last block (see :class:`SharedStorage`), and vLLM preempts for
    a running request's next block; client aborts release blocks before a verdict.

    The gate mutated, traces fail in every configuration: with ``_verdict`` returning
    True, or ``_kvguard_fail`` committing instead (a folder in place holds KV of a NaN
    step); with ``_verdict`` committing what still waits (KV of a step in flight or
    without a count); with ``_kvguard_fail`` keeping a loaded folder (its loading step
    failed, it stays); with ``kvguard_settle_stores`` doing nothing (a staged folder
    outlives its verdict)."""
    totals = _run_traces(8, ("full",), async_scheduling, storage=tmp_path, multi=multi)
    assert totals["nan"] > 0 and totals["unchecked"] > 0 and totals["aborted"] > 0
    assert totals["hit_tokens"] > 0 and totals["storage_stores"] > 0
    assert totals["storage_loads"] > 0 and totals["storage_failed_loads"] > 0
    assert totals["discarded"] > 0 and totals["purged"] > 0


@pytest.mark.skipif(not HAVE_NIXL, reason="NIXL's scheduler side imports nixl (nixl-cu12)")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("groups", [("full",), ("full", "sliding")], ids=["full", "full+sliding"])
def test_random_fault_traces_through_the_request_finished_gate_on_nixl(
    groups: tuple[str, ...], async_scheduling: bool
) -> None:
    """The same traces on a prefill instance behind vLLM's real NixlConnector (its
    scheduler side; :class:`NixlHandoff` plays the workers), every request carrying
    ``do_remote_decode`` and asking 1 to 15 tokens, steps failing or uncounted more
    often: a request is handed over exactly when it ended normally after steps all
    counted clean, by the trace's own record of what it injected (no over-withholding
    either); what it hands over is KV of clean steps, held until its send is
    reported, then freed; a withheld request's blocks are freed at once.

    The gate mutated, traces fail in every configuration: with
    ``withhold_from_connector`` calling vLLM's ``_connector_finished`` through (a
    request whose last step had no NaN count is handed over); with the guarded
    scheduler withholding every request (a clean one is not handed over); with its
    ``_connector_finished`` freeing the blocks of a handed-over request at once."""
    totals = _run_traces(6, groups, async_scheduling, nixl=True)
    assert totals["nan"] > 0 and totals["unchecked"] > 0 and totals["preempted"] > 0
    assert totals["aborted"] > 0 and totals["handoffs"] > 0 and totals["withheld"] > 0
    assert totals["handoffs_vouched"] > 0


@pytest.mark.parametrize("policy", ["fail", "recompute"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_random_fault_traces_with_kv_load_failures(async_scheduling: bool, policy: str) -> None:
    """Loads from the CPU tier that fail part-way (the worker reports the blocks it did
    not fill): under vLLM's ``fail`` policy the request ends, under ``recompute`` it
    recomputes them; either way no request ever reads those blocks' bytes, none is
    published, and everything else holds."""
    totals = _run_traces(4, ("full",), async_scheduling, offload=True, load_failure_policy=policy)
    assert totals["load_failures"] > 0 and totals["loaded"] > 0


SPEC_SHAPES = [("full",), ("full", "sliding"), ("full", "chunked"), ("full", "rswa")]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("groups", SPEC_SHAPES, ids=["+".join(g) for g in SPEC_SHAPES])
def test_random_fault_traces_with_speculative_decoding(
    groups: tuple[str, ...], async_scheduling: bool, per_request_nans: None
) -> None:
    """The same traces with speculative decoding (3 draft tokens): each decode step also
    computes the drafts proposed for its request (sync: the worker's, handed to the
    scheduler after the output; async: the worker's own, the scheduler scheduling
    placeholders) and the model accepts a leading run of them. The KV a step wrote at
    rejected positions belongs to another token prefix: it is never read as the
    request's, published or stored, and later steps overwrite it."""
    totals = _run_traces(3, groups, async_scheduling, spec_tokens=3)
    assert totals["drafts_accepted"] > 0 and totals["drafts_rejected"] > 0
    assert totals["nan"] > 0 and totals["unchecked"] > 0 and totals["preempted"] > 0
    assert totals["aborted"] > 0 and totals["hit_tokens"] > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("groups", [("full",), ("full", "sliding")], ids=["full", "full+sliding"])
def test_random_fault_traces_with_speculative_decoding_and_offloading(
    groups: tuple[str, ...], async_scheduling: bool, per_request_nans: None
) -> None:
    """Speculative decoding behind the guarded offloading connector, which stores the
    blocks of generated tokens too (where drafts are computed): no store job copies KV
    of rejected drafts, and what loads back passes the read checks."""
    totals = _run_traces(
        3, groups, async_scheduling, spec_tokens=3, offload=True, offload_outputs=True
    )
    assert totals["drafts_accepted"] > 0 and totals["drafts_rejected"] > 0
    assert totals["nan"] > 0 and totals["preempted"] > 0 and totals["aborted"] > 0
    assert totals["stored"] > 0 and totals["loaded"] > 0 and totals["evicted"] > 0
