"""The seeded workload: requests that share a handful of system prompts.

Each request is one of a few "system prompts" followed by its own user suffix, and asks
for a fixed number of greedy tokens (no stop token, so every policy and the ground truth
generate exactly the same number). Arrival steps are drawn with exponential gaps.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvguard.sim.config import Scenario


@dataclass(frozen=True, slots=True)
class RequestSpec:
    request_id: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival_step: int
    system_prompt: int
    """Which shared system prompt the request starts with."""


def make_workload(scenario: Scenario) -> list[RequestSpec]:
    """The scenario's requests in arrival order (a pure function of the scenario)."""
    rng = random.Random(f"workload/{scenario.seed}")
    vocab = scenario.model.vocab_size
    systems = [
        tuple(rng.randrange(vocab) for _ in range(scenario.system_prompt_tokens))
        for _ in range(scenario.num_system_prompts)
    ]
    out: list[RequestSpec] = []
    clock = 0.0
    lo, hi = scenario.user_tokens
    new_lo, new_hi = scenario.max_new_tokens
    for i in range(scenario.num_requests):
        clock += rng.expovariate(scenario.arrivals_per_step)
        system = rng.randrange(len(systems))
        user = tuple(rng.randrange(vocab) for _ in range(rng.randint(lo, hi)))
        out.append(
            RequestSpec(
                request_id=f"req-{i:04d}",
                prompt=systems[system] + user,
                max_new_tokens=rng.randint(new_lo, new_hi),
                arrival_step=int(clock),
                system_prompt=system,
            )
        )
    return out
