"""The fault plan: which request is hit, where, and how — fixed before any run.

A plan is a pure function of (workload, rate, kinds, seed), so every policy faces the
same faults. A planned fault fires when the request's own step computes the planned
token position; if a cache hit covers that position, the request never computes it and
the fault does not fire (a request counts as *faulted* only if its fault fired). A fault
fires at most once, so a recovered request recomputes cleanly.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvguard.sim.config import FaultKind
from kvguard.sim.workload import RequestSpec


@dataclass(frozen=True, slots=True)
class PlannedFault:
    kind: FaultKind
    position: int
    """Token position whose step the fault hits (and, for KV faults, whose K/V)."""
    layer: int
    """Layer of a KV fault (ignored by the other kinds)."""


def plan_faults(
    workload: Sequence[RequestSpec],
    rate: float,
    kinds: Sequence[FaultKind],
    *,
    num_layers: int,
    seed: int,
) -> dict[str, PlannedFault]:
    """Give each request a fault with probability ``rate``; request id -> fault."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"fault rate must be in [0, 1], got {rate}")
    if rate and not kinds:
        raise ValueError("a non-zero fault rate needs at least one fault kind")
    plan: dict[str, PlannedFault] = {}
    for spec in workload:
        # One generator per request: the plan of a request does not depend on the
        # others, so changing the rate adds faults without moving existing ones.
        rng = random.Random(f"faults/{seed}/{spec.request_id}")
        if rng.random() >= rate:
            continue
        # Positions that some step computes: the prompt and every generated token but
        # the last (whose K/V is never needed).
        last = len(spec.prompt) + spec.max_new_tokens - 1
        plan[spec.request_id] = PlannedFault(
            kind=kinds[rng.randrange(len(kinds))],
            position=rng.randrange(last),
            layer=rng.randrange(num_layers),
        )
    return plan
