"""What one run produced: each request's fate and the engine's counters."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    request_id: str
    finished: bool
    """False: aborted with an error."""
    output: tuple[int, ...]
    """Generated tokens (empty when aborted)."""
    fault: str | None
    """The kind of the request's own fault, if it fired."""
    error: str | None
    recoveries: int
    preemptions: int
    tokens_rolled_back: int
    """Tokens its recoveries rolled back to its validated boundary and recomputed, at
    every step it lost to a rank failure (0 when its policy aborts instead)."""
    tokens_if_blocks_dropped: int
    """What dropping the blocks those lost steps touched and preempting (vLLM PR
    #50265), or aborting and resubmitting, would have recomputed at the same losses
    (:func:`kvguard.recovery.recompute_after_lost_steps`)."""


@dataclass(slots=True)
class RunCounters:
    steps: int = 0
    tokens_computed: int = 0
    preemptions: int = 0
    query_tokens: int = 0
    gpu_hit_tokens: int = 0
    tier_hit_tokens: int = 0
    blocks_zeroed: int = 0
    bytes_zeroed: int = 0
    """Whole blocks zeroed on reuse plus token slots wiped by tail rollbacks (all layers)."""
    tail_slots_wiped: int = 0
    """Token slots ``zero_request_tail`` wiped: the tokens recovery rolled back to a
    validated boundary, recomputed (equal to ``tokens_in_lost_steps`` under a policy
    that recovers, 0 under one that aborts)."""
    tier_entries_written: int = 0
    tier_entries_from_failed_steps: int = 0
    """Tier entries whose bytes a failed step wrote (or that hold non-finite KV)."""
    tier_acks_dropped: int = 0
    """Copies the pool refused at ``ack_store`` (block quarantined or reused meanwhile)."""
    tier_entries_rotten: int = 0
    """Tier copies a tier-rot fault altered after they were stored (ground truth)."""
    tier_rotten_loads_served: int = 0
    """Loads of rotten tier copies whose KV a request then computed on."""
    tier_loads_refused: int = 0
    """Tier loads refused because their KV did not give the block's seal (the copy
    dropped, the tokens recomputed)."""
    blocks_audited: int = 0
    steps_lost: int = 0
    """Steps lost to a rank failure, as the policy saw them (``eager`` sees none): each
    took every request with a step in flight with it (under async scheduling also the
    requests of the next step, already run), rolled back or aborted by the policy."""
    requests_in_lost_steps: int = 0
    tokens_in_lost_steps: int = 0
    """Tokens those requests' lost steps computed: what rolling them back to their
    validated boundary recomputes (kvguard's rule, vLLM's ``recover()``)."""
    tokens_if_blocks_dropped: int = 0
    """Estimate for the same requests: dropping the blocks the lost steps touched and
    preempting (vLLM PR #50265), or aborting and resubmitting, recomputes everything
    but their published full blocks below the lost steps."""
    faults_fired: dict[str, int] = field(default_factory=dict)
    aborts: dict[str, int] = field(default_factory=dict)
    """Aborted requests by reason."""
    wall_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        hits = self.gpu_hit_tokens + self.tier_hit_tokens
        return hits / self.query_tokens if self.query_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_computed / self.wall_s if self.wall_s else 0.0


@dataclass(frozen=True, slots=True)
class RunResult:
    policy: str
    fault_rate: float
    outcomes: dict[str, RequestOutcome]
    counters: RunCounters
