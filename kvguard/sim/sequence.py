"""The engine's view of one request: its tokens, progress and fate."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvguard.sim.config import FaultKind
from kvguard.sim.faults import PlannedFault
from kvguard.sim.workload import RequestSpec


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False, slots=True)
class Seq:
    """``tokens`` is the device's view (prompt + every sampled token, including ones
    whose step is still in flight); ``delivered`` counts outputs the host has processed."""

    spec: RequestSpec
    fault: PlannedFault | None
    tokens: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    """Token positions whose K/V is written or scheduled to be (vLLM's num_computed_tokens,
    advanced at schedule time)."""
    delivered: int = 0
    epoch: int = 0
    """Bumped when in-flight results must be dropped (preemption, abort, rollback)."""
    pool_tokens: int = 0
    """How many token ids the pool knows (hashing); grows as outputs are delivered."""
    pool_prompt: int = 0
    """Token ids given to ``add_request`` at the last admission."""
    fault_fired: FaultKind | None = None
    error: str | None = None
    recoveries: int = 0
    preemptions: int = 0
    tokens_rolled_back: int = 0
    """Tokens of lost steps its recoveries rolled back (recomputed)."""
    tokens_if_blocks_dropped: int = 0
    """What the approaches that drop blocks would have recomputed at those losses."""

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def num_prompt(self) -> int:
        return len(self.spec.prompt)

    @property
    def num_outputs(self) -> int:
        return len(self.tokens) - len(self.spec.prompt)

    @property
    def done_computing(self) -> bool:
        """Every output token is sampled (the last one's K/V is never needed)."""
        return self.num_outputs >= self.spec.max_new_tokens

    @property
    def outputs(self) -> tuple[int, ...]:
        return tuple(self.tokens[len(self.spec.prompt) :])
