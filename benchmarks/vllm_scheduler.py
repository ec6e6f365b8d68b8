"""Stock vLLM 0.33 scheduler vs kvguard's guarded scheduler on one synthetic trace.

Hundreds of requests with shared prefixes, chunked prefill and decode, no NaN. Both
schedulers run the same trace *in lockstep*: at every step the stock and the guarded
scheduler each schedule and process a hand-built output, in alternating order, so
that a noisy neighbour or a frequency change on a shared machine hits both sides of a
step alike. (Their decisions differ only where the guard withholds a prefix hit on
blocks whose step has not validated yet, e.g. two requests with one new prefix admitted
in the same step.) Every round replays the same trace; the ratio of the summed
per-step best times (each step's fastest of all rounds, on each side) is the result.
Goal: guarded / stock <= 1.02. Run::

    python benchmarks/vllm_scheduler.py [--requests 400] [--rounds 7] [--async-scheduling]
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

_clock = time.perf_counter


class Side:
    """One scheduler and the time spent inside its schedule() / update_from_output()."""

    def __init__(self, guarded: bool, args: argparse.Namespace) -> None:
        self.scheduler: Any = make_scheduler(
            guarded=guarded,
            async_scheduling=args.async_scheduling,
            num_blocks=args.blocks,
            max_num_batched_tokens=512,
            max_num_seqs=64,
            kvguard={"check_invariants": False},
        )
        self.pending: list[Any] = []
        self.step_times: list[float] = []
        self.depth = 2 if args.async_scheduling else 1

    def step(self) -> None:
        s = self.scheduler
        start = _clock()
        so = s.schedule()
        elapsed = _clock() - start
        self.pending.append(so)
        if len(self.pending) == self.depth:
            done = self.pending.pop(0)
            mro = model_output(s, done)  # the "worker": not timed
            start = _clock()
            s.update_from_output(done, mro)
            elapsed += _clock() - start
        self.step_times.append(elapsed)


def run_round(args: argparse.Namespace, repeat: int) -> tuple[list[float], list[float]]:
    """One pass of the trace through both schedulers: per-step times (stock, guarded)."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(50_000) for _ in range(4 * BLOCK)] for _ in range(8)]
    arrivals: dict[int, list[tuple[str, list[int], int]]] = {}
    for i in range(args.requests):
        prompt = rng.choice(prefixes) + [
            rng.randrange(50_000) for _ in range(rng.randrange(8, 300))
        ]
        arrivals.setdefault(i // 4, []).append((f"r{i}", prompt, rng.randrange(8, 64)))
    stock, guarded = Side(False, args), Side(True, args)
    gc.collect()
    gc.freeze()  # set-up garbage and vLLM's own objects are not rescanned by timed steps
    last_arrival = max(arrivals)
    for t in range(10_000):
        for side in (stock, guarded):
            for rid, prompt, max_tokens in arrivals.get(t, ()):
                side.scheduler.add_request(make_request(rid, prompt, max_tokens))
        order = (stock, guarded) if t % 2 else (guarded, stock)
        for side in order:
            side.step()
        if t > last_arrival and not stock.scheduler.requests and not guarded.scheduler.requests:
            break
    gc.unfreeze()
    return stock.step_times, guarded.step_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--blocks", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async-scheduling", action="store_true")
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, vllm {vllm.__version__}, "
        f"{'async' if args.async_scheduling else 'sync'} scheduling"
    )
    stock_rounds: list[list[float]] = []
    guard_rounds: list[list[float]] = []
    for r in range(args.rounds):
        stock, guard = run_round(args, r)
        stock_rounds.append(stock)
        guard_rounds.append(guard)
        print(
            f"round {r}: {len(stock)} steps, stock {statistics.fmean(stock) * 1e6:7.1f} us/step, "
            f"guarded {statistics.fmean(guard) * 1e6:7.1f} us/step, "
            f"ratio {sum(guard) / sum(stock):.3f}"
        )
    # Every round replays the same trace, so step t does the same work in each: the
    # fastest of its R timings is that step's cost without the machine's noise
    # (interrupts, neighbours, frequency changes), on either side.
    best_stock = [min(times) for times in zip(*stock_rounds, strict=True)]
    best_guard = [min(times) for times in zip(*guard_rounds, strict=True)]
    pairs = zip(stock_rounds, guard_rounds, strict=True)
    median = statistics.median(sum(g) / sum(s) for s, g in pairs)
    print(f"stock vLLM   {statistics.fmean(best_stock) * 1e6:9.1f} us/step (each step's best)")
    print(f"kvguard      {statistics.fmean(best_guard) * 1e6:9.1f} us/step (each step's best)")
    print(f"median of per-round ratios: {median:.3f}")
    print(f"ratio guarded/stock = {sum(best_guard) / sum(best_stock):.3f} (goal <= 1.02)")


if __name__ == "__main__":
    main()
