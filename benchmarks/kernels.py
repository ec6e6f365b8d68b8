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

``--sweep`` re-derives the launch shapes instead (the constants at the top of
``zero_blocks``, ``audit_blocks`` and ``count_nonfinite``, chosen on an H200): it times
every combination of a grid of them on this GPU and prints each kernel's best ones and
where the current constants rank. ``--quick --sweep`` on CPU (under TRITON_INTERPRET=1)
only checks that the sweep runs.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import time
from collections.abc import Callable
from types import ModuleType

import torch

from kvguard import SlotRange
from kvguard.kernels import (
    KVCacheLayout,
    LayoutKind,
    audit_blocks,
    count_nonfinite_per_request,
    seal_blocks,
    seal_blocks_ref,
    zero_blocks,
    zero_slots,
)
from kvguard.kernels.backend import resolve_backend

BURST = 10
# The cache the GPU rows use: Llama-8B-like (block size 16; MLA: DeepSeek's 576-wide latent).
BLOCK_SIZE, MLA_DIM = 16, 576


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


def _caches(
    kind: LayoutKind, sizes: tuple[int, int, int, int], device: torch.device
) -> list[torch.Tensor]:
    """One zeroed bf16 cache per layer in ``kind``'s layout; ``sizes`` is (layers, blocks,
    heads, head_dim), and MLA caches are MLA_DIM wide."""
    layers, num_blocks, heads, head_dim = sizes
    dim = MLA_DIM if kind is LayoutKind.MLA else head_dim
    shape = _logical_shape(kind, num_blocks, BLOCK_SIZE, heads, dim)
    return [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(layers)]


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

    # seal_blocks: each block's 64-bit fingerprint across layers (reads every byte once),
    # against the torch path on the same device.
    t_seal = bench.time(lambda: seal_blocks(layout, ids))
    bench.report("seal_blocks", nbytes, t_seal, bench.time(lambda: seal_blocks_ref(layout, ids)))


# Launch-shape grids for --sweep: module -> {constant: candidate values}.
SWEEP_GRIDS: dict[str, dict[str, list[object]]] = {
    "zero_blocks": {
        "WORDS_PER_ITEM": [1024, 2048, 4096, 8192],
        "NUM_WARPS": [4, 8, 16],
        "NUM_STAGES": [1, 3],
        "EVICTION": ["", "evict_first"],
    },
    "audit_blocks": {
        "ELEMENTS_PER_ITEM": [4096, 8192, 16384, 32768],
        "NUM_WARPS": [4, 8, 16],
        "NUM_STAGES": [1, 3],
    },
    "seal_blocks": {
        "ELEMENTS_PER_ITEM": [2048, 4096, 8192, 16384],
        "NUM_WARPS": [4, 8, 16],
        "NUM_STAGES": [1, 3],
    },
    "count_nonfinite": {
        "COLUMNS_PER_LOAD": [512, 1024, 2048, 4096],
        "ITEMS_PER_PROGRAM": [1, 2, 4],
        "NUM_WARPS": [4, 8],
        "NUM_STAGES": [1, 3, 4],
    },
}


def _sweep(
    bench: Bench,
    module_name: str,
    workloads: list[tuple[str, Callable[[], object], int]],
    quick: bool,
) -> None:
    """Time every launch shape of ``SWEEP_GRIDS[module_name]`` on each workload (name,
    call, bytes moved) and rank the shapes by their worst fraction of the copy's rate."""
    module: ModuleType = importlib.import_module(f"kvguard.kernels.{module_name}")
    grid = SWEEP_GRIDS[module_name]
    if quick:  # a plumbing check: two values of each constant
        grid = {name: values[:2] for name, values in grid.items()}
    names = list(grid)
    current = tuple(getattr(module, name) for name in names)
    results: list[tuple[float, tuple[object, ...], list[float]]] = []
    try:
        for shape in itertools.product(*grid.values()):
            for name, value in zip(names, shape, strict=True):
                setattr(module, name, value)
            fractions = [
                _gbps(moved, bench.time(call)) / bench.ceiling(moved)
                for _, call, moved in workloads
            ]
            results.append((min(fractions), shape, fractions))
    finally:
        for name, value in zip(names, current, strict=True):
            setattr(module, name, value)
    results.sort(key=lambda r: r[0], reverse=True)
    header = ", ".join(w[0] for w in workloads)
    print(f"\n{module_name}: {len(results)} launch shapes, fraction of copy rate ({header})")
    rank = next((i for i, r in enumerate(results) if r[1] == current), None)
    if rank is None:
        print("  (the current constants are not in this grid)")
    for i, (_, shape, fractions) in enumerate(results):
        if i < 5 or i == rank:
            settings = " ".join(f"{n}={v!r}" for n, v in zip(names, shape, strict=True))
            mark = "  <- current" if i == rank else ""
            print(f"  #{i + 1:<3} {' '.join(f'{f:5.2f}' for f in fractions)}  {settings}{mark}")


def _sweep_all(bench: Bench, sizes: tuple[int, int, int, int], quick: bool) -> None:
    """Sweep each kernel on the benchmark's workloads (at full size the three layouts'
    caches are held at once: about 40 GB of GPU memory)."""
    num_blocks = sizes[1]
    device = bench.device
    ids = torch.randperm(num_blocks, device=device)[: num_blocks // 4]
    zero_loads: list[tuple[str, Callable[[], object], int]] = []
    flash: KVCacheLayout | None = None
    for kind in LayoutKind:
        layout = KVCacheLayout(_caches(kind, sizes, device), kind, block_size=BLOCK_SIZE)
        flash = layout if kind is LayoutKind.FLASH_ATTN else flash
        zero_loads.append(
            (
                kind.name.lower(),
                functools.partial(zero_blocks, layout, ids),
                layout.bytes_per_block * ids.numel(),
            )
        )
    _sweep(bench, "zero_blocks", zero_loads, quick)
    assert flash is not None
    audit_load = (
        "flash_attn",
        lambda: audit_blocks(flash, ids),
        flash.bytes_per_block * ids.numel(),
    )
    _sweep(bench, "audit_blocks", [audit_load], quick)
    seal_load = (
        "flash_attn",
        lambda: seal_blocks(flash, ids),
        flash.bytes_per_block * ids.numel(),
    )
    _sweep(bench, "seal_blocks", [seal_load], quick)
    rows, vocab = (512, 128_256) if device.type == "cuda" and not quick else (4, 64)
    logits = torch.randn(rows, vocab, device=device)
    cu_rows = torch.arange(0, rows + 1, 2, device=device)
    count_load = (
        f"{rows}x{vocab}",
        lambda: count_nonfinite_per_request(logits, cu_rows),
        logits.numel() * logits.element_size(),
    )
    _sweep(bench, "count_nonfinite", [count_load], quick)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, few repetitions")
    parser.add_argument("--sweep", action="store_true", help="re-derive the launch shapes")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    quick = args.quick or not cuda
    # A Llama-8B-like cache on GPU (32 layers, 8 KV heads, head_dim 128, bf16, block_size
    # 16; MLA: DeepSeek's 576-wide latent); a few layers and blocks on CPU.
    sizes = (4, 256, 8, 128) if quick else (32, 8192, 8, 128)
    num_blocks = sizes[1]
    bench = Bench(device, reps=5 if quick else 50)
    backend = resolve_backend("auto", device)
    print(
        f"device: {device} ({torch.cuda.get_device_name() if cuda else 'no CUDA'}), "
        f"kvguard backend: {backend}, torch {torch.__version__}"
    )
    if args.sweep:
        if backend != "triton":
            raise SystemExit(
                "--sweep times the Triton kernels: it needs CUDA or TRITON_INTERPRET=1"
            )
        if cuda:
            _sweep_all(bench, sizes, quick)
        else:  # the interpreter: a check that the sweep runs, on a toy cache
            _sweep_all(Bench(device, reps=1), (1, 8, 1, 16), quick=True)
        return
    if not cuda:
        print("NOTE: CPU run times the torch reference path; GPU figures need CUDA.\n")
    print(
        f"{'kernel':<22} {'bytes':>13} {'time':>12} {'rate':>13} {'copy ceiling':>13} "
        f"{'vs copy':>7} vs torch"
    )

    ids = torch.randperm(num_blocks, device=device)[: num_blocks // 4]
    for kind in LayoutKind:
        _layout_rows(bench, kind, _caches(kind, sizes, device), ids)
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
