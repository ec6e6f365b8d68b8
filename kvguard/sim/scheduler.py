"""A vLLM-v1-style scheduler over the kvguard pool: token budget, chunked prefill,
decode, preemption by recomputation, prefix-cache and CPU-tier hits.

Running requests are served first (in admission order), then waiting ones (FCFS). Each
scheduled request gets ``min(remaining, budget)`` tokens, so long prompts are prefilled
in chunks. When blocks run out, the most recently admitted running request is preempted:
its blocks are freed (the pool quarantines any written by a step still in flight) and it
restarts later from its delivered tokens.

The scheduler records each step with the pool as it schedules it (``pool.write``) — the
moment vLLM 0.33 publishes. Under a ``publish_at_schedule`` policy the step is also
declared valid right there (``validate_step`` before the forward pass runs), which makes
its blocks matchable and storable exactly when vLLM's ``allocate_slots`` caches them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvguard.hashing import BlockHash, hash_block_tokens
from kvguard.pool import BlockPool
from kvguard.sim.config import Policy, Scenario
from kvguard.sim.offload import CpuTier
from kvguard.sim.sequence import Seq, SeqStatus


@dataclass(frozen=True, slots=True)
class TierLoad:
    """Copy tier entries into freshly allocated blocks before the forward pass."""

    seq: Seq
    epoch: int
    block_ids: tuple[int, ...]
    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    seq: Seq
    epoch: int
    start: int
    end: int


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    loads: list[TierLoad] = field(default_factory=list)
    preempted: int = 0


@dataclass(slots=True)
class HitCounters:
    query_tokens: int = 0
    gpu_hit_tokens: int = 0
    tier_hit_tokens: int = 0


class Scheduler:
    def __init__(
        self,
        scenario: Scenario,
        policy: Policy,
        pool: BlockPool,
        tier: CpuTier | None,
        *,
        on_new_blocks: Callable[[tuple[int, ...]], None],
        on_committed: Callable[[Seq], None],
    ) -> None:
        self.scenario = scenario
        self.policy = policy
        self.pool = pool
        self.tier = tier
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.hits = HitCounters()
        self._on_new_blocks = on_new_blocks
        self._on_committed = on_committed

    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)

    # ------------------------------------------------------------------ pool commits

    def _commit(self, seq: Seq, num_tokens: int) -> None:
        """Record a scheduled write with the pool (and, eagerly, declare it valid)."""
        self.pool.write(seq.request_id, num_tokens)
        if self.policy.publish_at_schedule:
            self.pool.validate_step(seq.request_id)
            self._on_committed(seq)

    # ------------------------------------------------------------------ preemption

    def preempt(self, seq: Seq) -> None:
        """Free the request's blocks and send it back to the head of the queue."""
        self.pool.free(seq.request_id)
        self.running.remove(seq)
        # Outputs whose step is still in flight are dropped; they are recomputed.
        del seq.tokens[seq.num_prompt + seq.delivered :]
        seq.num_computed = 0
        seq.epoch += 1
        seq.preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ one step

    def schedule(self, step: int) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.scenario.max_batched_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running or seq.done_computing:
                continue  # preempted above, or waiting for its last output
            n = min(len(seq.tokens) - seq.num_computed, budget)
            if n <= 0:
                continue
            pool = self.pool
            while not pool.can_allocate(seq.request_id, seq.num_computed + n):
                victim = self.running[-1]
                self.preempt(victim)
                out.preempted += 1
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            self._on_new_blocks(pool.allocate(seq.request_id, seq.num_computed + n))
            self._commit(seq, n)
            out.chunks.append(
                ScheduledChunk(seq, seq.epoch, seq.num_computed, seq.num_computed + n)
            )
            seq.num_computed += n
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.scenario.max_running:
            seq = self.waiting[0]
            if seq.spec.arrival_step > step:
                break
            if not self._admit(seq, budget, out):
                break
            self.waiting.popleft()
            budget -= out.chunks[-1].end - out.chunks[-1].start
        return out

    def _admit(self, seq: Seq, budget: int, out: SchedulerOutput) -> bool:
        pool = self.pool
        size = pool.block_size
        tokens = seq.tokens
        pool.add_request(seq.request_id, tokens)
        seq.pool_tokens = seq.pool_prompt = len(tokens)
        # Keep one token to compute: its logits produce the next output.
        hit = pool.lookup(seq.request_id, max_tokens=len(tokens) - 1)
        load_hashes: list[BlockHash] = []
        if self.tier is not None:
            hashes = hash_block_tokens(tokens[: len(tokens) - 1], size)
            for block_hash in hashes[hit.num_blocks :]:
                if block_hash not in self.tier:
                    break
                load_hashes.append(block_hash)
        computed = hit.num_tokens + len(load_hashes) * size
        n = min(len(tokens) - computed, budget)
        if not pool.can_allocate(seq.request_id, computed + n, hit=hit):
            pool.free(seq.request_id)
            return False
        new = pool.allocate(seq.request_id, computed + n, hit=hit)
        self._on_new_blocks(new)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        if load_hashes:
            self._commit(seq, len(load_hashes) * size)
            out.loads.append(
                TierLoad(seq, seq.epoch, tuple(new[: len(load_hashes)]), tuple(load_hashes))
            )
        self._commit(seq, n)
        out.chunks.append(ScheduledChunk(seq, seq.epoch, computed, computed + n))
        seq.num_computed = computed + n
        hits = self.hits
        hits.query_tokens += len(tokens)
        hits.gpu_hit_tokens += hit.num_tokens
        hits.tier_hit_tokens += len(load_hashes) * size
        return True
