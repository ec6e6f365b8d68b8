"""Throughput of the kvguard kernels against the bandwidth ceiling and torch baselines.

On CUDA, each kernel's effective bytes per second is compared with (a) a device-to-device
copy of the same size measured in the same run (the memory-bandwidth ceiling; a zeroing
kernel writes N bytes, a copy reads and writes N, so the ceiling is counted as bytes
moved) and (b) the torch baselines an engine would otherwise use: ``index_fill_`` /
indexed assignment per layer, ``isfinite`` over the gathered blocks, and ``isnan().sum(-1)``
plus a segment sum. zero_blocks runs on each layout (FlashAttention, FlashInfer, MLA), and
once more with the 16 ids a scheduler step typically hands it (latency, not bandwidth).
Without CUDA it times the torch reference path only, on small shapes: GPU figures need a GPU.

Run: ``python benchmarks/kernels.py`` (``--quick`` for smaller shapes).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kvguard import SlotRange
from kvguard.kernels import (
    KVCacheLayout,
    LayoutKind,
    audit_blocks,
    count_nonfinite_per_request,
    zero_blocks,
    zero_slots,
)
from kvguard.kernels.backend import resolve_backend

BURST = 10


def _timeit(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds per call.

    On GPU each sample times ``BURST`` calls issued back to back between two CUDA events,
    as an engine queues work ahead of the GPU: a kernel is then timed without the host's
    launch gap in front of it, unless the host cannot keep up (small calls), in which
    case that host cost is what the sample shows. On CPU, perf_counter per call.
    """
    fn()  # warm-up: compilation, allocator
    times: list[float] = []
    for _ in range(reps):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            for _ in range(BURST):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / BURST)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _logical_shape(
    kind: LayoutKind, blocks: int, block_size: int, heads: int, dim: int
) -> tuple[int, ...]:
    if kind is LayoutKind.FLASH_ATTN:
        return (2, blocks, block_size, heads, dim)
    if kind is LayoutKind.FLASHINFER:
        return (blocks, 2, block_size, heads, dim)
    return (blocks, block_size, dim)  # MLA: one latent vector per token


class Bench:
    """Timings of one run, each against a copy of the same size measured in this run."""

    def __init__(self, device: torch.device, reps: int) -> None:
        self.device, self.reps = device, reps
        self._copy_gbps: dict[int, float] = {}

    def time(self, fn: Callable[[], object]) -> float:
        return _timeit(fn, self.device, self.reps)

    def ceiling(self, nbytes: int) -> float:
        """GB/s of a device-to-device copy of ``nbytes`` (bytes read + written)."""
        if nbytes not in self._copy_gbps:
            src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            dst = torch.empty_like(src)
            self._copy_gbps[nbytes] = _gbps(2 * nbytes, self.time(lambda: dst.copy_(src)))
            del src, dst
        return self._copy_gbps[nbytes]

    def report(self, name: str, moved: int, t_ours: float, t_base: float) -> None:
        ours = _gbps(moved, t_ours)
        ceiling = self.ceiling(moved)
        print(
            f"{name:<22} {moved / 2**20:9.1f} MiB {t_ours * 1e6:9.1f} us {ours:8.1f} GB/s "
            f"{ceiling:8.1f} GB/s {ours / ceiling:6.2f}x {t_base / t_ours:6.2f}x"
        )


def _layout_rows(
    bench: Bench, kind: LayoutKind, caches: list[torch.Tensor], ids: torch.Tensor
) -> None:
    """zero_blocks on one layout; zero_slots and audit_blocks on the FlashAttention one."""
    layout = KVCacheLayout(caches, kind, block_size=caches[0].shape[kind.token_dim])
    nbytes = layout.bytes_per_block * ids.numel()

    def torch_zero(these: torch.Tensor = ids) -> None:
        for c in caches:
            c.index_fill_(kind.block_dim, these, 0)

    t_zb = bench.time(lambda: zero_blocks(layout, ids))
    bench.report(f"zero_blocks {kind.name.lower()}", nbytes, t_zb, bench.time(torch_zero))
    if kind is not LayoutKind.FLASH_ATTN:
        return

    # A step's queue, as the pool hands it out: a list of ints (no range-check sync).
    step_ids = ids[:16]
    step_list = step_ids.tolist()
    t_step = bench.time(lambda: zero_blocks(layout, step_list))
    t_step_base = bench.time(lambda: torch_zero(step_ids))
    bench.report("zero_blocks 16 ids", layout.bytes_per_block * 16, t_step, t_step_base)

    # zero_slots: wipe the last 5 tokens of 64 requests' tail blocks, given as the pool's
    # SlotRanges (what CacheWiper drains).
    block_size = layout.block_size
    ranges = [SlotRange(b, 11, 16) for b in ids[:64].tolist()]
    tails = ids[:64] * block_size
    slots = (tails[:, None] + torch.arange(11, 16, device=ids.device)).flatten()
    blocks_idx, tok_idx = slots // block_size, slots % block_size

    def torch_zero_slots() -> None:
        for c in caches:
            c[:, blocks_idx, tok_idx] = 0

    t_zs = bench.time(lambda: zero_slots(layout, ranges))
    slot_bytes = layout.bytes_per_slot * slots.numel()
    bench.report("zero_slots", slot_bytes, t_zs, bench.time(torch_zero_slots))

    # audit_blocks: does any layer of each block hold a NaN/Inf (reads every byte).
    def torch_audit() -> torch.Tensor:
        bad = torch.zeros(ids.numel(), dtype=torch.bool, device=ids.device)
        for c in caches:
            gathered = c.index_select(1, ids).transpose(0, 1).reshape(ids.numel(), -1)
            bad |= ~torch.isfinite(gathered).all(-1)
        return bad

    t_audit = bench.time(lambda: audit_blocks(layout, ids))
    bench.report("audit_blocks", nbytes, t_audit, bench.time(torch_audit))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, few repetitions")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    quick = args.quick or not cuda
    # A Llama-8B-like cache on GPU (32 layers, 8 KV heads, head_dim 128, bf16, block_size
    # 16; MLA: DeepSeek's 576-wide latent); a few layers and blocks on CPU.
    layers, num_blocks, heads, head_dim = (4, 256, 8, 128) if quick else (32, 8192, 8, 128)
    block_size, dtype, mla_dim = 16, torch.bfloat16, 576
    bench = Bench(device, reps=5 if quick else 50)
    backend = resolve_backend("auto", device)
    print(
        f"device: {device} ({torch.cuda.get_device_name() if cuda else 'no CUDA'}), "
        f"kvguard backend: {backend}, torch {torch.__version__}"
    )
    if not cuda:
        print("NOTE: CPU run times the torch reference path; GPU figures need CUDA.\n")
    print(
        f"{'kernel':<22} {'bytes':>13} {'time':>12} {'rate':>13} {'copy ceiling':>13} "
        f"{'vs copy':>7} vs torch"
    )

    ids = torch.randperm(num_blocks, device=device)[: num_blocks // 4]
    for kind in LayoutKind:
        dim = mla_dim if kind is LayoutKind.MLA else head_dim
        shape = _logical_shape(kind, num_blocks, block_size, heads, dim)
        _layout_rows(
            bench,
            kind,
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
            ids,
        )
        if cuda:
            torch.cuda.empty_cache()  # the caches are gone: room for the next layout

    # NaN count: 256 requests, 2 rows each (speculative decoding), vocab 128k fp32.
    rows, vocab = (64, 32_000) if quick else (512, 128_256)
    logits = torch.randn(rows, vocab, device=device)
    cu_rows = torch.arange(0, rows + 1, 2, device=device)
    t_nan = bench.time(lambda: count_nonfinite_per_request(logits, cu_rows))

    def torch_nan_count() -> torch.Tensor:
        per_row = torch.isnan(logits).sum(-1)
        prefix = torch.cumsum(torch.nn.functional.pad(per_row, (1, 0)), 0)
        return prefix[cu_rows[1:]] - prefix[cu_rows[:-1]]

    bench.report("nan_count", logits.numel() * 4, t_nan, bench.time(torch_nan_count))
    print(
        "\nrate: bytes written (zeroing) or read (audit, NaN count) per second; copy ceiling: "
        "a device copy of the same byte count, read + write; vs torch: baseline time / ours."
    )
    if not cuda:
        print("(on CPU kvguard runs the same torch ops as the baseline: ratios ~1 are expected)")


if __name__ == "__main__":
    main()
