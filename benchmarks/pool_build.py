"""What a pool of ``--blocks`` blocks costs to build, kvguard against the installed vLLM.

Builds ``kvguard.BlockPool(n, 16)`` and, when vLLM is importable, vLLM's
``vllm.v1.core.block_pool.BlockPool(n, enable_caching=True, hash_block_size=16)``,
alternating, ``--repeats`` times each with the garbage collector left on (as an engine
builds its pool), and prints the best build time of each, the memory each pool holds
per block (tracemalloc, one more build each) and the ratios kvguard/vLLM::

    python benchmarks/pool_build.py                  # 1,000,000 blocks, 3 repeats
    python benchmarks/pool_build.py --blocks 100000
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import platform
import time
import tracemalloc
from collections.abc import Callable


def kvguard_pool(n: int) -> object:
    from kvguard import BlockPool

    return BlockPool(n, 16)


def vllm_pool(n: int) -> object:
    from vllm.v1.core.block_pool import BlockPool

    return BlockPool(n, enable_caching=True, hash_block_size=16)


def seconds(build: Callable[[int], object], n: int) -> float:
    start = time.perf_counter()
    pool = build(n)
    took = time.perf_counter() - start
    del pool
    gc.collect()
    return took


def bytes_per_block(build: Callable[[int], object], n: int) -> float:
    gc.collect()
    tracemalloc.start()
    pool = build(n)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del pool
    gc.collect()
    return held / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sides = {"kvguard": kvguard_pool}
    if importlib.util.find_spec("vllm") is not None:
        sides["vLLM"] = vllm_pool
    for build in sides.values():
        build(16)  # imports outside the timers
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, build in sides.items():
            times[name].append(seconds(build, args.blocks))
    memory = {name: bytes_per_block(build, args.blocks) for name, build in sides.items()}
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.2f}"
    )
    print(f"{args.blocks:,} blocks, best of {args.repeats}")
    for name in sides:
        print(f"{name:8} {min(times[name]):6.2f} s  {memory[name]:6.0f} bytes/block")
    if "vLLM" in sides:
        print(
            f"kvguard/vLLM: time {min(times['kvguard']) / min(times['vLLM']):.2f}, "
            f"memory {memory['kvguard'] / memory['vLLM']:.2f}"
        )


if __name__ == "__main__":
    main()
