"""The simulated engine: schedule, wipe, load, forward, store, validate — step by step.

One iteration of :meth:`Engine.run` is one engine step::

    schedule(k)  -> pool.write (and, eagerly, validate) for every scheduled chunk
    wipe         -> blocks/slots the pool queued for zeroing (before any KV is written)
    tier loads   -> copy CPU-tier entries into fresh blocks, validate the load
    forward(k)   -> write K/V, attend, logits; faults fire here; NaN count (+ KV audit)
    tier stores  -> copy blocks whose store was begun, then ack_store
    process      -> step k (sync) or step k-1 (async): validate or fail, deliver tokens,
                    begin stores; a step lost to a rank failure loses every request
                    with a step in flight (recovered with zero_request_tail, or aborted)

With async scheduling a step's result is processed after the next step was scheduled and
run, as in vLLM's async scheduler: a request admitted in between sees the earlier step's
blocks still unvalidated (WRITTEN) under kvguard, and already published under ``eager``.

A rank failure loses the whole step, as in a real engine: no request of that forward gets
its output, and under async scheduling neither does any request of the next step (vLLM's
fault handler drains its batch queue). Every request with a step in flight is handled as
the policy handles a rank failure (:meth:`Engine._lose_steps`), and the counters say what
it recomputes next to what dropping blocks (vLLM PR #50265) or resubmitting would.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvguard.hashing import BlockHash
from kvguard.pool import BlockPool
from kvguard.recovery import RecomputeCost, recompute_after_lost_steps
from kvguard.results import StoreTicket
from kvguard.sim.config import FaultKind, Policy, Scenario
from kvguard.sim.device import DeviceOps
from kvguard.sim.faults import PlannedFault
from kvguard.sim.kv_cache import PagedKVCache
from kvguard.sim.metrics import RequestOutcome, RunCounters, RunResult
from kvguard.sim.model import ChunkInput, TinyDecoder, greedy
from kvguard.sim.offload import TIER, CpuTier, TierEntry
from kvguard.sim.scheduler import ScheduledChunk, Scheduler, TierLoad
from kvguard.sim.sequence import Seq, SeqStatus
from kvguard.sim.workload import RequestSpec
from kvguard.states import MATCHABLE_STATES

# A run that has not drained after this many steps is stuck (a bug, not a workload).
MAX_STEPS = 1_000_000


@dataclass(frozen=True, slots=True)
class ChunkResult:
    """What the host learns about one request when a step's output arrives."""

    chunk: ScheduledChunk
    sampled: int | None
    nan_count: int
    rank_failed: bool
    """A rank failed during this chunk's forward (any request's fault): the step is lost."""
    audit_failed: bool


class Engine:
    def __init__(
        self,
        scenario: Scenario,
        policy: Policy,
        model: TinyDecoder,
        workload: Sequence[RequestSpec],
        faults: dict[str, PlannedFault],
        fault_rate: float = 0.0,
    ) -> None:
        cfg = model.config
        self.scenario = scenario
        self.policy = policy
        self.model = model
        self.fault_rate = fault_rate
        self.pool = BlockPool(
            scenario.num_blocks,
            scenario.block_size,
            zero_policy=policy.zero_policy,
            check_invariants=scenario.check_invariants,
        )
        self.cache = PagedKVCache(
            cfg.num_layers, scenario.num_blocks, scenario.block_size, cfg.num_heads, cfg.head_dim
        )
        self.device = DeviceOps(self.pool, self.cache)
        self.tier = CpuTier(scenario.tier_blocks) if scenario.tier_blocks else None
        self.scheduler = Scheduler(
            scenario,
            policy,
            self.pool,
            self.tier,
            on_new_blocks=self._forget_provenance,
            on_committed=self._offer_stores,
        )
        self.seqs = [Seq(spec, faults.get(spec.request_id), list(spec.prompt)) for spec in workload]
        self.counters = RunCounters()
        # Ground truth for the tier metric: blocks written by a step that failed (whatever
        # the policy did about it), until they are zeroed, wiped or handed out again.
        self._failed_writes: set[int] = set()
        self._store_jobs: list[StoreTicket] = []
        # Store tickets whose tier copy a tier-rot fault alters once stored, and the
        # requests whose tier-rot fault fired (it harms readers, not the request).
        self._rot_tickets: set[int] = set()
        self._rotted: set[str] = set()

    # ------------------------------------------------------------------ the loop

    def run(self, on_step: Callable[[], None] | None = None) -> RunResult:
        start = time.perf_counter()
        arrivals = deque(sorted(self.seqs, key=lambda s: s.spec.arrival_step))
        sched = self.scheduler
        pending: list[ChunkResult] | None = None
        step = 0
        while True:
            while arrivals and arrivals[0].spec.arrival_step <= step:
                sched.add(arrivals.popleft())
            idle = pending is None and not sched.running
            out = sched.schedule(step)
            self.counters.preemptions += out.preempted
            self._wipe()
            self._load(out.loads)
            record = self._forward([c for c in out.chunks if c.seq.epoch == c.epoch])
            self._run_store_jobs()
            if self.scenario.async_scheduling:
                if pending is not None:
                    self._process(pending, record)  # ``record``: the next step, in flight
                pending = record
            elif record is not None:
                self._process(record, None)
            step += 1
            self.counters.steps += 1
            if on_step is not None:
                on_step()
            if pending is None and not sched.running:
                if not sched.waiting:
                    if not arrivals:
                        break
                    step = max(step, arrivals[0].spec.arrival_step)
                elif idle and record is None:
                    raise RuntimeError(
                        f"request {sched.waiting[0].request_id} cannot be scheduled even on "
                        f"an idle engine: num_blocks={self.scenario.num_blocks} is too small"
                    )
            if step > MAX_STEPS:
                raise RuntimeError("the simulation did not drain; this is a bug")
        self._run_store_jobs()
        self.counters.wall_s = time.perf_counter() - start
        hits = sched.hits
        self.counters.query_tokens = hits.query_tokens
        self.counters.gpu_hit_tokens = hits.gpu_hit_tokens
        self.counters.tier_hit_tokens = hits.tier_hit_tokens
        self.pool.check_invariants()
        return RunResult(self.policy.name, self.fault_rate, self._outcomes(), self.counters)

    def _outcomes(self) -> dict[str, RequestOutcome]:
        out: dict[str, RequestOutcome] = {}
        for seq in self.seqs:
            assert seq.status in (SeqStatus.FINISHED, SeqStatus.ABORTED), seq
            finished = seq.status is SeqStatus.FINISHED
            out[seq.request_id] = RequestOutcome(
                request_id=seq.request_id,
                finished=finished,
                output=seq.outputs if finished else (),
                fault=seq.fault_fired.value if seq.fault_fired else None,
                error=seq.error,
                recoveries=seq.recoveries,
                preemptions=seq.preemptions,
                tokens_rolled_back=seq.tokens_rolled_back,
                tokens_if_blocks_dropped=seq.tokens_if_blocks_dropped,
            )
        return out

    # ------------------------------------------------------------------ device side

    def _wipe(self) -> None:
        blocks, written = self.device.flush_zeroing()
        self.counters.blocks_zeroed += len(blocks)
        self.counters.bytes_zeroed += written
        self._failed_writes.difference_update(blocks)

    def _load(self, loads: Sequence[TierLoad]) -> None:
        assert self.tier is not None or not loads
        for load in loads:
            seq = load.seq
            entries = [self.tier.get(h) for h in load.hashes]  # type: ignore[union-attr]
            for block_id, entry in zip(load.block_ids, entries, strict=True):
                self.cache.load_block(block_id, entry.data)
                if entry.from_failed_step:
                    self._failed_writes.add(block_id)
            seals = None
            if self.policy.verify_seals:
                seals = dict(zip(load.block_ids, self.device.seal(load.block_ids), strict=True))
                refused = [
                    h
                    for block_id, h, entry in zip(load.block_ids, load.hashes, entries, strict=True)
                    if entry.seal is None or seals[block_id] != entry.seal
                ]
                if refused:
                    self._refuse_load(seq, refused)
                    continue
            self.counters.tier_rotten_loads_served += sum(e.rotten for e in entries)
            if self.policy.publish_at_schedule:
                continue  # declared valid when it was scheduled
            if self.policy.audit_kv:
                self.counters.blocks_audited += len(load.block_ids)
                if any(self.device.audit(load.block_ids)):
                    self._abort(seq, "KV audit (tier load)")
                    continue
            # The tier only ever received validated bytes: the load is valid once landed
            # (and, sealed, verified: the KV its blocks' validation vouched for).
            self.pool.validate_step(seq.request_id, seals)

    def _refuse_load(self, seq: Seq, hashes: Sequence[BlockHash]) -> None:
        """Tier copies whose loaded KV does not give their seal: each is dropped from
        the tier, and the request rolls back to its validated boundary -- before the
        load -- and recomputes those tokens (the step computing on them is dropped)."""
        for block_hash in hashes:
            self.tier.remove(block_hash)  # type: ignore[union-attr]
            self.pool.forget_tier_copy(TIER, block_hash)
        self.counters.tier_loads_refused += 1
        self._recover(seq)

    def _forward(self, chunks: list[ScheduledChunk]) -> list[ChunkResult] | None:
        if not chunks:
            return None
        size = self.scenario.block_size
        inputs: list[ChunkInput] = []
        fired: list[FaultKind | None] = []
        tables: list[tuple[int, ...]] = []
        for c in chunks:
            seq = c.seq
            fault = seq.fault
            kind: FaultKind | None = None
            if (
                fault is not None
                and fault.kind is not FaultKind.TIER_ROT  # (fires at its tier store)
                and seq.fault_fired is None
                and c.start <= fault.position < c.end
            ):
                kind = seq.fault_fired = fault.kind
                fired_counts = self.counters.faults_fired
                fired_counts[kind.value] = fired_counts.get(kind.value, 0) + 1
            table = self.pool.block_table(seq.request_id)
            where = (fault.layer, fault.position) if fault is not None else None
            inputs.append(
                ChunkInput(
                    seq.tokens[c.start : c.end],
                    c.start,
                    table,
                    kv_fault=where if kind is FaultKind.KV_NAN else None,
                    late_kv_fault=where if kind is FaultKind.KV_LATE else None,
                )
            )
            fired.append(kind)
            tables.append(table)
        logits = self.model.forward(inputs, self.cache)
        for i, kind in enumerate(fired):
            if kind is FaultKind.LOGITS_NAN:
                logits[i] = float("nan")
        nan_counts = self.device.count_nonfinite(logits)
        sampled = greedy(logits).tolist()
        written = [
            tables[i][c.start // size : (c.end - 1) // size + 1] for i, c in enumerate(chunks)
        ]
        rank_failed = FaultKind.RANK_FAILURE in fired
        if rank_failed:
            # A rank died mid-step: everything the step wrote, for every request, is garbage.
            for i, c in enumerate(chunks):
                self.cache.poison(None, self.cache.slot_index(tables[i], c.start, c.end))
        audit_failed = [False] * len(chunks)
        if self.policy.audit_kv:
            flat = [b for ids in written for b in ids]
            flags = iter(self.device.audit(flat))
            audit_failed = [any([next(flags) for _ in ids]) for ids in written]
            self.counters.blocks_audited += len(flat)
        results: list[ChunkResult] = []
        for i, c in enumerate(chunks):
            seq = c.seq
            token = None
            if c.end == len(seq.tokens):  # every known token computed: sample the next
                token = sampled[i]
                seq.tokens.append(token)
            if rank_failed or fired[i] is not None or nan_counts[i]:
                self._failed_writes.update(written[i])
            results.append(ChunkResult(c, token, nan_counts[i], rank_failed, audit_failed[i]))
            self.counters.tokens_computed += c.end - c.start
        return results

    # ------------------------------------------------------------------ tier stores

    def _offer_stores(self, seq: Seq) -> None:
        """Begin copies of the request's storable blocks; they run after the next forward."""
        if self.tier is None:
            return
        pool = self.pool
        fault = seq.fault
        rot_at = -1
        if (
            fault is not None
            and fault.kind is FaultKind.TIER_ROT
            and seq.request_id not in self._rotted
        ):
            table = pool.block_table(seq.request_id)
            index = fault.position // self.scenario.block_size
            rot_at = table[index] if index < len(table) else -1
        for block_id in pool.storable_blocks(seq.request_id, TIER):
            ticket = pool.begin_store(block_id, TIER)
            self._store_jobs.append(ticket)
            if block_id == rot_at:
                self._rot_tickets.add(ticket.ticket_id)
                self._rotted.add(seq.request_id)
                fired = self.counters.faults_fired
                fired[FaultKind.TIER_ROT.value] = fired.get(FaultKind.TIER_ROT.value, 0) + 1

    def _run_store_jobs(self) -> None:
        assert self.tier is not None or not self._store_jobs
        jobs, self._store_jobs = self._store_jobs, []
        pool = self.pool
        counters = self.counters
        for ticket in jobs:
            rotten = ticket.ticket_id in self._rot_tickets
            self._rot_tickets.discard(ticket.ticket_id)
            data = self.cache.block_data(ticket.block_id)
            bad = ticket.block_id in self._failed_writes or not bool(torch.isfinite(data).all())
            if not pool.ack_store(ticket):
                counters.tier_acks_dropped += 1
                continue
            counters.tier_entries_written += 1
            counters.tier_entries_from_failed_steps += bad
            if rotten:  # once stored, an exponent bit flips in the first token's K and V
                data[0, :, 0].view(torch.int32).bitwise_xor_(1 << 27)  # (layer 0; finite)
                counters.tier_entries_rotten += 1
            entry = TierEntry(data, bad, ticket.seal, rotten)
            for evicted in self.tier.put(ticket.block_hash, entry):  # type: ignore[union-attr]
                pool.forget_tier_copy(TIER, evicted)

    # ------------------------------------------------------------------ host side

    def _process(self, results: list[ChunkResult], later: list[ChunkResult] | None) -> None:
        """Handle one step's output; ``later``: the next step's, in flight (async)."""
        policy = self.policy
        pool = self.pool
        if not policy.publish_at_schedule:
            live = [r.chunk.seq for r in results if _live(r)]
            if live and results[0].rank_failed:
                self._lose_steps([*live, *(r.chunk.seq for r in later or () if _live(r))])
                return
        for r in results:
            seq = r.chunk.seq
            if not _live(r):
                continue  # dropped: preempted, aborted or rolled back since
            if policy.publish_at_schedule:
                # vLLM 0.33 only counts NaNs; nothing is withheld or rolled back (a rank
                # failure goes unnoticed: its garbage KV stays and is published).
                self._deliver(seq, r.sampled)
                if seq.status is SeqStatus.RUNNING:
                    self._offer_stores(seq)  # blocks that became hashable just now
                continue
            if policy.abort_on_nan and r.nan_count:
                self._abort(seq, "NaN logits")
                continue
            if r.audit_failed:
                self._abort(seq, "KV audit")
                continue
            pool.validate_step(seq.request_id, self._seals_of(r.chunk))
            self._deliver(seq, r.sampled)
            if seq.status is SeqStatus.RUNNING:
                self._offer_stores(seq)

    def _seals_of(self, chunk: ScheduledChunk) -> dict[int, int] | None:
        """Under a policy that verifies seals: the seals of the blocks ``chunk`` wrote,
        taken now (its step's KV, as it validates)."""
        if not self.policy.verify_seals:
            return None
        size = self.scenario.block_size
        table = self.pool.block_table(chunk.seq.request_id)
        ids = table[chunk.start // size : (chunk.end - 1) // size + 1]
        return dict(zip(ids, self.device.seal(ids), strict=True))

    def _deliver(self, seq: Seq, token: int | None) -> None:
        if token is None:
            return
        seq.delivered += 1
        assert seq.tokens[seq.num_prompt + seq.delivered - 1] == token
        # The host learns the token now: its block can be hashed (and published).
        self._sync_pool_tokens(seq)
        if seq.delivered == seq.spec.max_new_tokens:
            self._offer_stores(seq)
            self.pool.free(seq.request_id)
            self.scheduler.running.remove(seq)
            seq.status = SeqStatus.FINISHED

    def _sync_pool_tokens(self, seq: Seq) -> None:
        known = seq.num_prompt + seq.delivered
        if known > seq.pool_tokens:
            self.pool.append_tokens(seq.request_id, seq.tokens[seq.pool_tokens : known])
            seq.pool_tokens = known

    def _abort(self, seq: Seq, reason: str) -> None:
        self.pool.fail_step(seq.request_id)
        self.pool.free(seq.request_id)
        self.scheduler.running.remove(seq)
        seq.status = SeqStatus.ABORTED
        seq.error = reason
        seq.epoch += 1
        self.counters.aborts[reason] = self.counters.aborts.get(reason, 0) + 1

    def _lose_steps(self, seqs: list[Seq]) -> None:
        """A rank failed: the step's output never arrives, nor (async) the next one's.
        Every request with a step in flight (``seqs``) rolls back to its validated
        boundary under ``tail_recovery`` (kvguard, like ``recover()`` in vLLM) and is
        aborted otherwise (vLLM's fault handler, PR #50283). What each approach
        recomputes is read before any request is touched."""
        counters = self.counters
        counters.steps_lost += 1
        costs = [(seq, self._recompute_cost(seq)) for seq in dict.fromkeys(seqs)]
        for seq, cost in costs:
            counters.requests_in_lost_steps += 1
            counters.tokens_in_lost_steps += cost.rollback
            counters.tokens_if_blocks_dropped += cost.drop_blocks
            seq.tokens_if_blocks_dropped += cost.drop_blocks
            if self.policy.tail_recovery:
                self._recover(seq)
            else:
                self._abort(seq, "rank failure")

    def _recompute_cost(self, seq: Seq) -> RecomputeCost:
        """What the request recomputes if its steps in flight are lost now, by approach."""
        pool = self.pool
        progress = pool.progress(seq.request_id)
        published = 0
        for block_id in pool.block_table(seq.request_id):
            if pool.block_state(block_id) not in MATCHABLE_STATES:
                break
            published += 1
        written = progress.num_written_tokens
        return recompute_after_lost_steps(
            written, written - progress.num_validated_tokens, pool.block_size, published
        )

    def _recover(self, seq: Seq) -> None:
        """Wipe the request's unvalidated tail and resume from its surviving KV."""
        wipe, written = self.device.zero_request_tail(seq.request_id)
        self.counters.bytes_zeroed += written
        self.counters.tail_slots_wiped += wipe.num_tokens_wiped
        seq.tokens_rolled_back += wipe.num_tokens_wiped
        self._failed_writes.difference_update(s.block_id for s in wipe.slots)
        boundary = wipe.num_tokens
        # Tokens at positions <= boundary are prompt tokens or outputs of validated steps.
        keep = min(len(seq.tokens), max(boundary + 1, seq.num_prompt))
        del seq.tokens[keep:]
        seq.delivered = keep - seq.num_prompt
        seq.num_computed = boundary
        # The pool kept the ids up to and including the boundary (the last one was
        # sampled by a validated step) and dropped later ones; give back what we keep.
        seq.pool_tokens = min(seq.pool_tokens, max(boundary + 1, seq.pool_prompt))
        self._sync_pool_tokens(seq)
        seq.epoch += 1
        seq.recoveries += 1

    def _forget_provenance(self, block_ids: tuple[int, ...]) -> None:
        self._failed_writes.difference_update(block_ids)


def _live(result: ChunkResult) -> bool:
    """The result's request still waits for it (not preempted, aborted or rolled back
    since the step was scheduled)."""
    seq = result.chunk.seq
    return seq.epoch == result.chunk.epoch and seq.status is SeqStatus.RUNNING
