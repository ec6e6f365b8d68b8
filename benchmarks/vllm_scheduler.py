"""Stock vLLM 0.33 scheduler vs kvguard's guarded scheduler on one synthetic trace.

Hundreds of requests with shared prefixes, chunked prefill and decode, no NaN: both
schedulers run the same trace in one process (each driven through schedule() ->
update_from_output() with hand-built outputs) and the ratio of their mean step times
is printed. Goal: guarded / stock <= 1.02. Run::

    VLLM_COMPUTE_NANS_IN_LOGITS=1 python benchmarks/vllm_scheduler.py [--requests 400]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import sys
import time
import warnings
from typing import Any

os.environ.setdefault("VLLM_COMPUTE_NANS_IN_LOGITS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import vllm

    from tests.vllm.harness import BLOCK, make_request, make_scheduler, model_output


def run(guarded: bool, args: argparse.Namespace, repeat: int) -> float:
    # The previous run's scheduler (reference cycles) is collected now, not during
    # this run's timed steps.
    gc.collect()
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(50_000) for _ in range(4 * BLOCK)] for _ in range(8)]
    arrivals: dict[int, list[tuple[str, list[int], int]]] = {}
    for i in range(args.requests):
        prompt = rng.choice(prefixes) + [
            rng.randrange(50_000) for _ in range(rng.randrange(8, 300))
        ]
        arrivals.setdefault(i // 4, []).append((f"r{i}", prompt, rng.randrange(8, 64)))
    s: Any = make_scheduler(
        guarded=guarded,
        async_scheduling=args.async_scheduling,
        num_blocks=args.blocks,
        max_num_batched_tokens=512,
        max_num_seqs=64,
        kvguard={"check_invariants": False},
    )
    t = 0
    elapsed = 0.0
    steps = 0
    pending: list[Any] = []
    while t < 10_000:
        for rid, prompt, max_tokens in arrivals.get(t, ()):
            s.add_request(make_request(f"{rid}.{repeat}", prompt, max_tokens))
        start = time.perf_counter()
        so = s.schedule()
        elapsed += time.perf_counter() - start
        pending.append(so)
        if not args.async_scheduling or len(pending) == 2:
            done = pending.pop(0)
            mro = model_output(s, done)
            start = time.perf_counter()
            s.update_from_output(done, mro)
            elapsed += time.perf_counter() - start
        steps += 1
        t += 1
        if t > max(arrivals) and not s.requests:
            break
    return elapsed / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--blocks", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async-scheduling", action="store_true")
    args = parser.parse_args()
    stock: list[float] = []
    guard: list[float] = []
    ratios: list[float] = []
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, vllm {vllm.__version__}"
    )
    for r in range(args.rounds):  # interleaved, so drift hits both alike
        stock.append(run(False, args, r))
        guard.append(run(True, args, r))
        ratios.append(guard[-1] / stock[-1])
        print(
            f"round {r}: stock {stock[-1] * 1e6:7.1f} us/step, "
            f"guarded {guard[-1] * 1e6:7.1f} us/step, ratio {ratios[-1]:.3f}"
        )
    print(f"stock vLLM   mean step {statistics.median(stock) * 1e6:9.1f} us (median of rounds)")
    print(f"kvguard      mean step {statistics.median(guard) * 1e6:9.1f} us (median of rounds)")
    print(
        f"ratio guarded/stock = {statistics.median(ratios):.3f} (median of per-round ratios; "
        "goal <= 1.02)"
    )


if __name__ == "__main__":
    main()
