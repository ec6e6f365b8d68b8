"""Throughput of the kvguard kernels against the bandwidth ceiling and torch baselines.

On CUDA, each kernel's effective bytes per second is compared with (a) a device-to-device
copy of the same size measured in the same run (the memory-bandwidth ceiling; a zeroing
kernel writes N bytes, a copy reads and writes N, so the ceiling is counted as bytes
moved) and (b) the torch baselines an engine would otherwise use: ``index_fill_`` /
indexed assignment per layer, and ``isnan().sum(-1)`` plus a segment sum. Without CUDA it
times the torch reference path only, on small shapes: GPU figures need a GPU.

Run: ``python benchmarks/kernels.py`` (``--quick`` for smaller shapes).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kvguard.kernels import (
    KVCacheLayout,
    LayoutKind,
    count_nonfinite_per_request,
    zero_blocks,
    zero_slots,
)
from kvguard.kernels.backend import resolve_backend


def _timeit(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds per call (CUDA events on GPU, perf_counter on CPU)."""
    fn()  # warm-up: compilation, allocator
    times: list[float] = []
    for _ in range(reps):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, few repetitions")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    quick = args.quick or not cuda
    # A Llama-8B-like cache on GPU (32 layers, 8 KV heads, head_dim 128, bf16,
    # block_size 16); a few layers and blocks on CPU.
    layers, num_blocks, heads, head_dim = (4, 256, 8, 128) if quick else (32, 8192, 8, 128)
    block_size, dtype = 16, torch.bfloat16
    reps = 5 if quick else 50
    backend = resolve_backend("auto", device)
    print(
        f"device: {device} ({torch.cuda.get_device_name() if cuda else 'no CUDA'}), "
        f"kvguard backend: {backend}"
    )
    if not cuda:
        print("NOTE: CPU run times the torch reference path; GPU figures need CUDA.\n")

    caches = [
        torch.zeros(2, num_blocks, block_size, heads, head_dim, dtype=dtype, device=device)
        for _ in range(layers)
    ]
    layout = KVCacheLayout(caches, LayoutKind.FLASH_ATTN, block_size=block_size)
    ids = torch.randperm(num_blocks, device=device)[: num_blocks // 4]
    id_list = ids.tolist()
    nbytes = layout.bytes_per_block * len(id_list)

    # (a) ceiling: a device-to-device copy of the same number of bytes.
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t_copy = _timeit(lambda: dst.copy_(src), device, reps)
    ceiling = _gbps(2 * nbytes, t_copy)  # a copy reads and writes

    def report(name: str, moved: int, t_ours: float, t_base: float) -> None:
        ours = _gbps(moved, t_ours)
        print(
            f"{name:<18} {moved / 2**20:9.1f} MiB  {t_ours * 1e6:9.1f} us  {ours:8.1f} GB/s  "
            f"{ours / ceiling:6.2f}x copy  {t_base / t_ours:6.2f}x torch baseline"
        )

    print(f"copy ceiling: {ceiling:.1f} GB/s (read+write of {nbytes / 2**20:.1f} MiB)")
    print(f"{'kernel':<18} {'bytes':>13}  {'time':>12}  {'rate':>13}  {'vs copy':>11}  vs torch")

    # zero_blocks vs index_fill_ per layer.
    t_zb = _timeit(lambda: zero_blocks(layout, ids), device, reps)

    def torch_zero_blocks() -> None:
        for c in caches:
            c.index_fill_(1, ids, 0)

    report("zero_blocks", nbytes, t_zb, _timeit(torch_zero_blocks, device, reps))

    # zero_slots: wipe the last 5 tokens of 64 requests' tail blocks.
    tails = ids[:64] * block_size
    slots = (tails[:, None] + torch.arange(11, 16, device=device)).flatten()
    slot_bytes = layout.bytes_per_slot * slots.numel()
    t_zs = _timeit(lambda: zero_slots(layout, slots), device, reps)
    blocks_idx, tok_idx = slots // block_size, slots % block_size

    def torch_zero_slots() -> None:
        for c in caches:
            c[:, blocks_idx, tok_idx] = 0

    report("zero_slots", slot_bytes, t_zs, _timeit(torch_zero_slots, device, reps))

    # NaN count: 256 requests, 2 rows each (speculative decoding), vocab 128k fp32.
    rows, vocab = (64, 32_000) if quick else (512, 128_256)
    logits = torch.randn(rows, vocab, device=device)
    cu_rows = torch.arange(0, rows + 1, 2, device=device)
    t_nan = _timeit(lambda: count_nonfinite_per_request(logits, cu_rows), device, reps)

    def torch_nan_count() -> torch.Tensor:
        per_row = torch.isnan(logits).sum(-1)
        prefix = torch.cumsum(torch.nn.functional.pad(per_row, (1, 0)), 0)
        return prefix[cu_rows[1:]] - prefix[cu_rows[:-1]]

    report("nan_count", logits.numel() * 4, t_nan, _timeit(torch_nan_count, device, reps))
    if not cuda:
        print("\n(on CPU kvguard runs the same torch ops as the baseline: ratios ~1 are expected)")


if __name__ == "__main__":
    main()
