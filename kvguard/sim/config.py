"""What a simulation runs: the policies compared, the fault kinds, and named scenarios.

A :class:`Scenario` fixes everything that makes two runs comparable — model, cache size,
scheduler limits, workload and fault plan — so every policy sees the same requests and
the same planned faults, and the fault-free run of the same scenario is the ground truth.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from kvguard.zeroing import ZeroPolicy


class FaultKind(enum.Enum):
    KV_NAN = "kv"
    """NaN in the K/V a step computes for one position of one layer, stored in the cache
    before attention reads it (a bad projection or a corrupt write in the forward pass)."""
    LOGITS_NAN = "logits"
    """NaN in the logits row of one request (a bad sampler input); the KV stays clean."""
    RANK_FAILURE = "rank"
    """A rank fails during the step, which is lost as a whole, as in a real engine: every
    slot the step wrote, for every request in it, is garbled (every layer), and the
    engine learns of it with the step's output. Every request with a step in flight (under
    async scheduling also those of the next step, already run) is then handled as the
    policy handles a rank failure (:attr:`Policy.tail_recovery`)."""
    KV_LATE = "kv-late"
    """NaN written into one cached K/V slot *after* the layer's attention read it: the
    step's logits stay finite, so only a KV audit catches it (opt-in: it shows what the
    audit is for, and plain ``kvguard`` is expected to let it through)."""
    TIER_ROT = "tier"
    """The CPU-tier copy of the request's block holding the planned position rots once
    stored: an exponent bit flips in every value of its first token's K and V in layer 0
    (the values stay finite).
    The request itself is untouched; whoever loads the copy later reads wrong KV that
    no NaN check sees, unless the load is verified by the block's seal (opt-in kind)."""


DEFAULT_FAULT_KINDS = (FaultKind.KV_NAN, FaultKind.LOGITS_NAN, FaultKind.RANK_FAILURE)


@dataclass(frozen=True, slots=True)
class Policy:
    """How the engine treats KV written by a step it has not checked yet."""

    name: str
    publish_at_schedule: bool
    """vLLM 0.33: blocks become matchable and storable when the step is scheduled."""
    abort_on_nan: bool
    """Fail the step (abort the request alone) when its logits hold NaN."""
    zero_policy: ZeroPolicy
    audit_kv: bool = False
    """Scan the blocks a step wrote for non-finite values before they are published."""
    tail_recovery: bool = False
    """On a rank failure, roll every request with a step in flight back to its validated
    boundary with ``zero_request_tail`` and resume it (what kvguard's ``recover()`` does
    in vLLM). Otherwise a policy that defers publication aborts them all (vLLM's fault
    handler), and one that publishes at schedule time does not notice the failure."""
    guarded: bool = True
    """A kvguard policy: any corruption escape under it makes ``kvguard simulate`` fail."""
    verify_seals: bool = False
    """Seal each block when its step validates (``validate_step(..., seals=)``), carry
    the seal with its tier copy, and refuse a tier load whose KV does not give it: the
    copy is dropped and the request recomputes those tokens."""
    description: str = ""


EAGER = Policy(
    "eager",
    publish_at_schedule=True,
    abort_on_nan=False,
    zero_policy=ZeroPolicy.NONE,
    guarded=False,
    description=(
        "vLLM 0.33: publish and offload at schedule time, no abort, no zeroing, "
        "rank failures unnoticed"
    ),
)
DEFER_ZERO_ALL = Policy(
    "defer-zero-all",
    publish_at_schedule=False,
    abort_on_nan=True,
    zero_policy=ZeroPolicy.ALL,
    guarded=False,
    description=(
        "vLLM PR #50283: defer publication, abort on NaN, zero every new block, abort "
        "every request of a step lost to a rank failure"
    ),
)
KVGUARD = Policy(
    "kvguard",
    publish_at_schedule=False,
    abort_on_nan=True,
    zero_policy=ZeroPolicy.SUSPECT,
    tail_recovery=True,
    verify_seals=True,
    description=(
        "kvguard: defer, abort alone, zero suspect blocks only, roll every request of a "
        "step lost to a rank failure back and resume, verify tier loads by their seals"
    ),
)
KVGUARD_AUDIT = dataclasses.replace(
    KVGUARD,
    name="kvguard-audit",
    audit_kv=True,
    description="kvguard plus a KV audit of every written block before publication",
)

POLICIES: dict[str, Policy] = {p.name: p for p in (EAGER, DEFER_ZERO_ALL, KVGUARD, KVGUARD_AUDIT)}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 16
    vocab_size: int = 64
    mlp_ratio: int = 4
    max_position: int = 512
    seed: int = 1234


@dataclass(frozen=True, slots=True)
class Scenario:
    """One reproducible workload on one engine configuration."""

    name: str
    model: ModelConfig = ModelConfig()
    block_size: int = 4
    num_blocks: int = 48
    max_batched_tokens: int = 64
    """Token budget per step (chunked prefill splits prompts to fit)."""
    max_running: int = 8
    async_scheduling: bool = True
    """Schedule step N+1 before step N's output (and its validation) is processed."""
    num_requests: int = 48
    num_system_prompts: int = 4
    system_prompt_tokens: int = 24
    user_tokens: tuple[int, int] = (4, 12)
    """Inclusive range of each request's own prompt suffix length."""
    max_new_tokens: tuple[int, int] = (6, 12)
    arrivals_per_step: float = 1.0
    """Mean request arrivals per engine step (exponential gaps)."""
    tier_blocks: int = 256
    """Capacity of the CPU offload tier, in blocks (0 turns offloading off)."""
    fault_rate: float = 0.3
    """Fraction of requests that get one planned fault (it fires only if the request
    computes the planned position itself rather than hitting it in a cache)."""
    fault_kinds: tuple[FaultKind, ...] = DEFAULT_FAULT_KINDS
    sweep: tuple[float, ...] = (0.0, 0.3)
    """Fault rates of the sweep behind the plot."""
    seed: int = 1
    check_invariants: bool = False
    """Run ``BlockPool.check_invariants`` after every pool mutation (slow; tests)."""

    def problems(self) -> list[str]:
        """Why this scenario cannot run, one line each (empty: it can). Checked before a
        run, so that a bad size is an input error, not a crash half-way through."""
        out: list[str] = []
        for name in ("num_blocks", "num_requests", "block_size", "max_batched_tokens"):
            value = getattr(self, name)
            if value < 1:
                out.append(f"{name} must be at least 1, got {value}")
        if self.tier_blocks < 0:
            out.append(f"tier_blocks must be 0 (no tier) or more, got {self.tier_blocks}")
        if out:
            return out
        longest = self.system_prompt_tokens + self.user_tokens[1] + self.max_new_tokens[1]
        if longest > self.model.max_position:
            out.append(
                f"a request may reach {longest} tokens, past the model's "
                f"{self.model.max_position} positions"
            )
        need = -(-longest // self.block_size)
        if need > self.num_blocks:
            out.append(
                f"num_blocks={self.num_blocks} is too small: the longest request needs "
                f"{need} blocks of {self.block_size} tokens"
            )
        return out

    def memory_bytes(self) -> int:
        """A generous estimate of the peak memory a run takes: the KV cache and the
        tier's copies (float32, every layer), the pool's records, the workload."""
        m = self.model
        block_bytes = m.num_layers * 2 * self.block_size * m.num_heads * m.head_dim * 4
        per_block = block_bytes + 512  # the pool's and the cache's bookkeeping
        longest = self.system_prompt_tokens + self.user_tokens[1] + self.max_new_tokens[1]
        per_request = 64 * longest + 2048  # token lists, outputs, per-request records
        return 2 * ((self.num_blocks + self.tier_blocks) * per_block) + (
            self.num_requests * per_request
        )

    def with_overrides(self, **changes: object) -> Scenario:
        """A copy with the given fields replaced (``None`` values are ignored)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})  # type: ignore[arg-type]


SCENARIOS: dict[str, Scenario] = {
    # Small enough for CI (~10 s for everything); seeded so eager shows escapes.
    "ci": Scenario("ci"),
    # The README's scenario: more requests, more prefixes, memory pressure that evicts
    # system prompts (so they are recomputed and reloaded from the CPU tier).
    "default": Scenario(
        "default",
        num_requests=96,
        num_blocks=56,
        num_system_prompts=6,
        user_tokens=(4, 16),
        max_new_tokens=(6, 16),
        arrivals_per_step=1.2,
        fault_rate=0.2,
        sweep=(0.0, 0.1, 0.2, 0.3),
        seed=0,
    ),
}
