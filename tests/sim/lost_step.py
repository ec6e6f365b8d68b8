"""The real-engine fault trace of ``tests/e2e/test_recover.py``, in the simulator.

32-token blocks and 64 tokens per step: b (a 40-token prompt) is decoding while a (150
tokens) prefills in chunks, and a rank fails during the step computing a's tokens
24..86 and b's token 40 (a's planned fault at position 80). The step is lost for both.
``tests/sim/test_lost_step.py`` checks the figures; ``tests/vllm/test_recover.py``
checks that vLLM's guarded scheduler reports the same on the same trace.
"""

from __future__ import annotations

from kvguard.sim import POLICIES, FaultKind, Scenario
from kvguard.sim.engine import Engine
from kvguard.sim.faults import PlannedFault
from kvguard.sim.metrics import RunResult
from kvguard.sim.model import TinyDecoder
from kvguard.sim.runner import single_thread
from kvguard.sim.workload import RequestSpec

BLOCK = 32
CHUNK = 64
MAX_TOKENS = 6
FAULT_POSITION = 80
"""In a's second chunk (24..86), the step that also decodes b's token 40."""

EXPECTED = {
    # Sync (the e2e test's engine): the lost step computed a's 24..86 and b's 40. kvguard
    # rolls a back to 24 and b to 40 (its partial block keeps its 8 validated tokens):
    # 63 + 1. Dropping the touched blocks or resubmitting keeps only b's published first
    # block: 87 + 9.
    False: {"a": (63, 87), "b": (1, 9)},
    # Async: the next step (a's 87..149, b's 41) was in flight too and is lost with it.
    True: {"a": (126, 150), "b": (2, 10)},
}
"""Per scheduling mode (async?), per request: (rolled back, recomputed if the blocks are
dropped) -- the figures both the simulator and vLLM's guarded scheduler must give."""


def prompts() -> dict[str, tuple[int, ...]]:
    """b first: it is admitted first and runs first in every step, as in vLLM."""
    return {"b": tuple(range(40)), "a": tuple(i % 61 for i in range(7, 157))}


def run_trace(policy: str, *, async_scheduling: bool, fault: bool = True) -> RunResult:
    scenario = Scenario(
        "e2e-recover",
        block_size=BLOCK,
        num_blocks=16,
        max_batched_tokens=CHUNK,
        async_scheduling=async_scheduling,
        tier_blocks=0,
        check_invariants=True,
    )
    workload = [
        RequestSpec(rid, prompt, MAX_TOKENS, arrival_step=0, system_prompt=0)
        for rid, prompt in prompts().items()
    ]
    faults = {"a": PlannedFault(FaultKind.RANK_FAILURE, FAULT_POSITION, layer=0)} if fault else {}
    engine = Engine(scenario, POLICIES[policy], TinyDecoder(scenario.model), workload, faults)
    with single_thread():
        return engine.run()


def recompute(result: RunResult) -> dict[str, tuple[int, int]]:
    """Per request: (tokens rolled back and recomputed, what dropping the touched
    blocks and preempting, or resubmitting, would have recomputed)."""
    return {
        rid: (o.tokens_rolled_back, o.tokens_if_blocks_dropped)
        for rid, o in result.outcomes.items()
    }
