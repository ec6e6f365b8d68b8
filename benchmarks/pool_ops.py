"""Pool-operation micro-benchmark: kvguard's ``BlockPool`` against the installed vLLM's.

One run drives the same operation trace through kvguard and, when ``vllm`` is
importable, through vLLM's ``vllm.v1.core.block_pool.BlockPool`` and
``vllm.v1.core.kv_cache_manager.KVCacheManager``, and prints per-operation times in
microseconds with the ratio kvguard/vLLM (<= 1.0: kvguard is at least as fast).

Trace:

(a) allocate one block + free it, ``--pairs`` times
    (``allocate_blocks(1)`` + ``release_blocks`` vs ``get_new_blocks(1)`` + ``free_blocks``);
(b) ``--batch-size`` blocks allocated then freed, ``--batches`` times (same APIs);
(c) ``--requests`` requests of ``--prompt-len`` tokens sharing a ``--prefix-len``-token
    prefix: prefix lookup, allocate the prompt, ``--decode-steps`` decode steps, free.
    kvguard validates after every step (the gating that vLLM does not do).
(d) kvguard alone: would a batch form of ``validate_step`` pay? For each of
    ``--batch-requests`` requests a step, ``--batch-steps`` decode steps of that many
    requests, each step's results given alternately by one ``validate_step`` call per
    request and by one call of :func:`validate_steps_sketch` over them all (same pool,
    same requests: load from elsewhere hits both alike); the median step of each, per
    request, and the ratio batch/calls. It pays if that ratio is at most
    ``PAYS_AT_MOST`` at every size of 64 requests or more.

Hashing (``--hashing``): ``excluded`` (default) keeps block hashing out of every timed
region on both sides -- vLLM's ``Request`` hashes its prompt when it is built and its new
full blocks in ``append_output_token_ids``, both outside the timer; kvguard is handed
precomputed hashes (``add_request(block_hashes=...)``, ``append_block_hashes``), whose
bookkeeping stays inside the timer. ``included`` times each side hashing with its own
default hasher (vLLM: SHA-256 of a pickle; kvguard: BLAKE2b-128): the vLLM request's
hasher is attached and run inside the prompt timer, ``append_output_token_ids`` runs
inside the decode timer; kvguard gets raw token ids and hashes lazily in
``lookup``/``validate_step``.

Each measurement is the best (lowest mean per operation) of ``--repeats`` runs on a
fresh pool, after a warm-up run, with the garbage collector off while timing; the
repeats of the two sides alternate so that load from elsewhere hits both alike (the
1-minute load average is printed: compare ratios, not absolute times, on a busy box).
Run ``python benchmarks/pool_ops.py --help`` for the options; ``--quick`` is a
seconds-long smoke run.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import os
import platform
import random
import statistics
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from time import perf_counter_ns
from typing import Any

from kvguard import BlockPool, StepOutcome, StepResult, TokenRange
from kvguard.errors import PoolMisuseError
from kvguard.hashing import BlockHash, hash_block_tokens
from kvguard.states import BlockState

VOCAB = 32_000


@dataclass(frozen=True)
class Config:
    pairs: int = 100_000
    batches: int = 10_000
    batch_size: int = 32
    requests: int = 2_000
    prompt_len: int = 1_024
    prefix_len: int = 512
    decode_steps: int = 32
    block_size: int = 16
    repeats: int = 5
    hashing: str = "excluded"
    seed: int = 0
    batch_requests: tuple[int, ...] = (8, 64, 256)
    batch_steps: int = 256

    @property
    def blocks_per_request(self) -> int:
        return -(-(self.prompt_len + self.decode_steps) // self.block_size)

    @property
    def trace_c_blocks(self) -> int:
        # Every request's blocks stay cached after free(): size the pool so nothing is
        # ever evicted and both pools see the same hits.
        return self.requests * self.blocks_per_request + 1_024


QUICK = Config(pairs=2_000, batches=200, requests=40, repeats=1, batch_steps=16)


@dataclass
class Result:
    """Best mean time per operation (ns) for each row, plus the prefix-hit counts."""

    per_op_ns: dict[str, float] = field(default_factory=dict)
    hit_tokens: int = 0
    query_tokens: int = 0

    def keep_best(self, row: str, total_ns: int, count: int) -> None:
        mean = total_ns / count
        old = self.per_op_ns.get(row)
        if old is None or mean < old:
            self.per_op_ns[row] = mean


ROW_PAIR = "(a) alloc 1 + free, per pair"
ROW_BATCH = "(b) alloc {n} + free, per batch"
ROW_PROMPT = "(c) prompt allocation, per request"
ROW_DECODE = "(c) decode step"
ROW_FREE = "(c) free, per request"


def _batch_row(cfg: Config) -> str:
    return ROW_BATCH.format(n=cfg.batch_size)


@dataclass(frozen=True)
class Workload:
    """The token ids of trace (c), shared by both sides."""

    prompts: list[list[int]]
    outputs: list[list[int]]
    hashes: list[list[BlockHash]]
    """kvguard block hashes of prompt + outputs (used with ``--hashing excluded``)."""


def make_workload(cfg: Config, num_requests: int) -> Workload:
    rng = random.Random(cfg.seed)
    prefix = [rng.randrange(VOCAB) for _ in range(cfg.prefix_len)]
    prompts: list[list[int]] = []
    outputs: list[list[int]] = []
    hashes: list[list[BlockHash]] = []
    for _ in range(num_requests):
        prompt = prefix + [rng.randrange(VOCAB) for _ in range(cfg.prompt_len - cfg.prefix_len)]
        out = [rng.randrange(VOCAB) for _ in range(cfg.decode_steps)]
        prompts.append(prompt)
        outputs.append(out)
        hashes.append(hash_block_tokens(prompt + out, cfg.block_size))
    return Workload(prompts, outputs, hashes)


def _timed_gc_off(fn: Callable[[], None]) -> None:
    gc.collect()
    gc.disable()
    try:
        fn()
    finally:
        gc.enable()


@dataclass(frozen=True)
class Side:
    """One implementation's three trace runners."""

    pairs: Callable[[int, Result], None]
    batches: Callable[[int, int, str, Result], None]
    requests: Callable[[Config, Workload, Result, int], None]


# ---------------------------------------------------------------------------- kvguard


def kvguard_pairs(n: int, result: Result) -> None:
    pool = BlockPool(4_096, 16)
    alloc = pool.allocate_blocks
    release = pool.release_blocks

    def run() -> None:
        t0 = perf_counter_ns()
        for _ in range(n):
            release(alloc(1))
        result.keep_best(ROW_PAIR, perf_counter_ns() - t0, n)

    _timed_gc_off(run)


def kvguard_batches(n: int, size: int, row: str, result: Result) -> None:
    pool = BlockPool(4_096, 16)
    alloc = pool.allocate_blocks
    release = pool.release_blocks

    def run() -> None:
        t0 = perf_counter_ns()
        for _ in range(n):
            release(alloc(size))
        result.keep_best(row, perf_counter_ns() - t0, n)

    _timed_gc_off(run)


def kvguard_requests(cfg: Config, work: Workload, result: Result, num_blocks: int) -> None:
    size = cfg.block_size
    explicit = cfg.hashing == "excluded"
    pool = BlockPool(num_blocks, size)
    prompt_len = cfg.prompt_len
    max_hit = prompt_len - 1  # keep one prompt token to compute, as vLLM does
    t_prompt = t_decode = t_free = 0
    hit_tokens = 0
    n_req = len(work.prompts)

    def run() -> None:
        nonlocal t_prompt, t_decode, t_free, hit_tokens
        add_request = pool.add_request
        lookup = pool.lookup
        allocate = pool.allocate
        write = pool.write
        validate = pool.validate_step
        append_tokens = pool.append_tokens
        append_hashes = pool.append_block_hashes
        free = pool.free
        prompt_blocks = prompt_len // size
        for i in range(n_req):
            rid = f"req-{i}"
            prompt = work.prompts[i]
            outputs = work.outputs[i]
            hashes = work.hashes[i]
            t0 = perf_counter_ns()
            if explicit:
                add_request(rid, prompt, block_hashes=hashes[:prompt_blocks])
            else:
                add_request(rid, prompt)
            hit = lookup(rid, max_tokens=max_hit)
            allocate(rid, prompt_len, hit=hit)
            write(rid, prompt_len - hit.num_tokens)
            validate(rid)
            t1 = perf_counter_ns()
            t_prompt += t1 - t0
            hit_tokens += hit.num_tokens
            num_tokens = prompt_len
            for tok in outputs:
                t0 = perf_counter_ns()
                append_tokens(rid, (tok,))
                num_tokens += 1
                if explicit and num_tokens % size == 0:
                    append_hashes(rid, (hashes[num_tokens // size - 1],))
                allocate(rid, num_tokens)
                write(rid, 1)
                validate(rid)
                t_decode += perf_counter_ns() - t0
            t0 = perf_counter_ns()
            free(rid)
            t_free += perf_counter_ns() - t0

    _timed_gc_off(run)
    result.keep_best(ROW_PROMPT, t_prompt, n_req)
    result.keep_best(ROW_DECODE, t_decode, n_req * cfg.decode_steps)
    result.keep_best(ROW_FREE, t_free, n_req)
    result.hit_tokens = hit_tokens
    result.query_tokens = n_req * prompt_len


def kvguard_side() -> Side:
    return Side(
        pairs=kvguard_pairs,
        batches=kvguard_batches,
        requests=kvguard_requests,
    )


# ------------------------------------------------------- (d) a batch form, sketched

PAYS_AT_MOST = 0.90
"""A batch form pays if one call costs at most this fraction of the single calls it
replaces (10 % saved) at every size of 64 requests a step or more."""

_WRITTEN = BlockState.WRITTEN
_VALIDATED = BlockState.VALIDATED


def validate_steps_sketch(pool: BlockPool, request_ids: Sequence[str]) -> list[StepResult]:
    """What a batch ``validate_steps(request_ids)`` could do at best, for measuring
    only (it is not kvguard's API): one checking pass over every id, then one applying
    pass that inlines :meth:`BlockPool.validate_step`'s body, its per-call dispatch and
    lookups gone. It reads the pool's private parts, as only kvguard's own code may;
    ``tests/test_pool_ops_batch_sketch.py`` checks that it leaves the pool, results and
    events exactly as the single calls do."""
    steps = pool.request_steps
    requests = steps._requests
    records = []
    for request_id in request_ids:
        rec = requests.get(request_id)
        if rec is None or not (rec.discarded or (rec.pending and not rec.aborted)):
            raise PoolMisuseError(f"validate_steps: {request_id!r} has no result to take")
        records.append(rec)
    if len(set(request_ids)) != len(records):
        raise PoolMisuseError("validate_steps: a request named twice")
    kernel = steps._kernel
    blocks = kernel.blocks
    size = steps._block_size
    publish_ready = steps._publish_ready
    results: list[StepResult] = []
    validated = 0
    for rec in records:
        if rec.discarded:
            results.append(steps._discard(rec))
            continue
        end = rec.pending.popleft()
        start = rec.num_validated
        rec.num_validated = end
        table = rec.blocks
        last = (end - 1) // size if rec.num_written <= end else end // size - 1
        for i in range(start // size, last + 1):
            block = blocks[table[i]]
            if block.state is _WRITTEN:
                block.state = _VALIDATED
        validated += 1
        published = publish_ready(rec) if end // size > rec.publish_cursor else ()
        results.append(
            StepResult(
                rec.request_id,
                StepOutcome.VALIDATED,
                TokenRange(start, end),
                end,
                published=published,
            )
        )
    kernel.counters.steps_validated += validated
    return results


def batch_validation(cfg: Config, num_requests: int) -> tuple[float, float]:
    """Row (d) for one size: the median step's time per request (ns) with one
    ``validate_step`` call per request, and with one :func:`validate_steps_sketch`
    call; the two alternate step by step over the same requests."""
    size = cfg.block_size
    prompt_len = 4 * size
    total = prompt_len + cfg.batch_steps
    pool = BlockPool(num_requests * (-(-total // size) + 1), size)
    rng = random.Random(cfg.seed)
    ids = [f"req-{i}" for i in range(num_requests)]
    hashes: dict[str, list[BlockHash]] = {}
    for rid in ids:
        tokens = [rng.randrange(VOCAB) for _ in range(total)]
        hashes[rid] = hash_block_tokens(tokens, size)
        pool.add_request(rid, tokens[:prompt_len], block_hashes=hashes[rid][: prompt_len // size])
        pool.allocate(rid, prompt_len)
        pool.write(rid, prompt_len)
        pool.validate_step(rid)
    single: list[int] = []
    batch: list[int] = []
    validate = pool.validate_step

    def run() -> None:
        for step in range(cfg.batch_steps):
            num_tokens = prompt_len + step + 1
            for rid in ids:  # schedule the step (untimed)
                if num_tokens % size == 0:
                    pool.append_block_hashes(rid, (hashes[rid][num_tokens // size - 1],))
                pool.allocate(rid, num_tokens)
                pool.write(rid, 1)
            if step % 2:
                t0 = perf_counter_ns()
                validate_steps_sketch(pool, ids)
                batch.append(perf_counter_ns() - t0)
            else:
                t0 = perf_counter_ns()
                for rid in ids:
                    validate(rid)
                single.append(perf_counter_ns() - t0)

    _timed_gc_off(run)
    return statistics.median(single) / num_requests, statistics.median(batch) / num_requests


def batch_report(cfg: Config, rows: Sequence[tuple[int, float, float]]) -> list[str]:
    lines = [
        f"(d) validate_step: N calls vs one batch call over the same N requests (a sketch, "
        f"not in the API); per request, median of {cfg.batch_steps} alternating steps",
        f"{'requests/step':>14}{'N calls us':>12}{'batch us':>12}{'batch/calls':>13}",
    ]
    for n, calls, one in rows:
        lines.append(f"{n:>14}{calls / 1e3:>12.3f}{one / 1e3:>12.3f}{one / calls:>13.2f}")
    large = [one / calls for n, calls, one in rows if n >= 64]
    if large:
        pays = "yes" if max(large) <= PAYS_AT_MOST else "no"
        lines.append(
            f"(d) a batch form pays (batch/calls <= {PAYS_AT_MOST:.2f} at 64+ requests): {pays}"
        )
    return lines


# ---------------------------------------------------------------------------- vLLM


@dataclass(frozen=True)
class Vllm:
    """The pieces of vLLM (0.32-0.34) the benchmark drives (vllm is untyped here: Any)."""

    version: str
    BlockPool: Any
    KVCacheManager: Any
    KVCacheConfig: Any
    KVCacheGroupSpec: Any
    FullAttentionSpec: Any
    Request: Any
    SamplingParams: Any
    hash_fn: Any
    get_request_block_hasher: Any
    dtype: Any


def load_vllm() -> Vllm | None:
    """Import the vLLM classes, or None when vllm is not importable."""
    if importlib.util.find_spec("vllm") is None:
        return None
    with warnings.catch_warnings():
        # torch/vllm emit deprecation warnings at import time; they are not ours.
        warnings.simplefilter("ignore")
        try:
            vllm = importlib.import_module("vllm")
            block_pool = importlib.import_module("vllm.v1.core.block_pool")
            manager = importlib.import_module("vllm.v1.core.kv_cache_manager")
            utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
            iface = importlib.import_module("vllm.v1.kv_cache_interface")
            request = importlib.import_module("vllm.v1.request")
            sampling = importlib.import_module("vllm.sampling_params")
            hashing = importlib.import_module("vllm.utils.hashing")
            torch = importlib.import_module("torch")
        except ImportError as exc:
            print(f"note: vllm is installed but failed to import ({exc})", file=sys.stderr)
            return None
    # vLLM's default prefix_caching_hash_algo is "sha256".
    utils.init_none_hash(hashing.sha256)
    return Vllm(
        version=str(getattr(vllm, "__version__", "?")),
        BlockPool=block_pool.BlockPool,
        KVCacheManager=manager.KVCacheManager,
        KVCacheConfig=iface.KVCacheConfig,
        KVCacheGroupSpec=iface.KVCacheGroupSpec,
        FullAttentionSpec=iface.FullAttentionSpec,
        Request=request.Request,
        SamplingParams=sampling.SamplingParams,
        hash_fn=hashing.sha256,
        get_request_block_hasher=utils.get_request_block_hasher,
        dtype=torch.float16,
    )


def vllm_pairs(v: Vllm, n: int, result: Result) -> None:
    pool = v.BlockPool(4_096, enable_caching=True, hash_block_size=16)
    get = pool.get_new_blocks
    free = pool.free_blocks

    def run() -> None:
        t0 = perf_counter_ns()
        for _ in range(n):
            free(get(1))
        result.keep_best(ROW_PAIR, perf_counter_ns() - t0, n)

    _timed_gc_off(run)


def vllm_batches(v: Vllm, n: int, size: int, row: str, result: Result) -> None:
    pool = v.BlockPool(4_096, enable_caching=True, hash_block_size=16)
    get = pool.get_new_blocks
    free = pool.free_blocks

    def run() -> None:
        t0 = perf_counter_ns()
        for _ in range(n):
            free(get(size))
        result.keep_best(row, perf_counter_ns() - t0, n)

    _timed_gc_off(run)


def make_vllm_manager(v: Vllm, cfg: Config, num_blocks: int) -> Any:
    spec = v.FullAttentionSpec(
        block_size=cfg.block_size, num_kv_heads=8, head_size=128, dtype=v.dtype
    )
    kv_config = v.KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[v.KVCacheGroupSpec(["layer.0"], spec)],
    )
    return v.KVCacheManager(
        kv_config,
        max_model_len=cfg.prompt_len + cfg.decode_steps + cfg.block_size,
        scheduler_block_size=cfg.block_size,
        hash_block_size=cfg.block_size,
        enable_caching=True,
    )


def vllm_requests(v: Vllm, cfg: Config, work: Workload, result: Result, num_blocks: int) -> None:
    manager = make_vllm_manager(v, cfg, num_blocks)
    hasher = v.get_request_block_hasher(cfg.block_size, v.hash_fn)
    params = v.SamplingParams(max_tokens=cfg.decode_steps)
    included = cfg.hashing == "included"
    # Requests are built (and, with hashing excluded, their prompts hashed) untimed.
    requests = [
        v.Request(f"req-{i}", list(p), params, None, block_hasher=None if included else hasher)
        for i, p in enumerate(work.prompts)
    ]
    prompt_len = cfg.prompt_len
    t_prompt = t_decode = t_free = 0
    hit_tokens = 0

    def run() -> None:
        nonlocal t_prompt, t_decode, t_free, hit_tokens
        get_computed_blocks = manager.get_computed_blocks
        allocate_slots = manager.allocate_slots
        free = manager.free
        for req, outputs in zip(requests, work.outputs, strict=True):
            t0 = perf_counter_ns()
            if included:
                req._block_hasher = hasher
                req.update_block_hashes()
            computed, num_computed, _ = get_computed_blocks(req)
            if allocate_slots(req, prompt_len - num_computed, num_computed, computed) is None:
                raise RuntimeError("vLLM pool ran out of blocks")
            req.num_computed_tokens = prompt_len  # what the scheduler does after scheduling
            t1 = perf_counter_ns()
            t_prompt += t1 - t0
            hit_tokens += num_computed
            for tok in outputs:
                if included:
                    t0 = perf_counter_ns()
                    req.append_output_token_ids(tok)
                else:
                    req.append_output_token_ids(tok)
                    t0 = perf_counter_ns()
                if allocate_slots(req, 1) is None:
                    raise RuntimeError("vLLM pool ran out of blocks")
                req.num_computed_tokens += 1
                t_decode += perf_counter_ns() - t0
            t0 = perf_counter_ns()
            free(req)
            t_free += perf_counter_ns() - t0

    _timed_gc_off(run)
    n_req = len(requests)
    result.keep_best(ROW_PROMPT, t_prompt, n_req)
    result.keep_best(ROW_DECODE, t_decode, n_req * cfg.decode_steps)
    result.keep_best(ROW_FREE, t_free, n_req)
    result.hit_tokens = hit_tokens
    result.query_tokens = n_req * prompt_len


def vllm_side(v: Vllm) -> Side:
    return Side(
        pairs=lambda n, result: vllm_pairs(v, n, result),
        batches=lambda n, size, row, result: vllm_batches(v, n, size, row, result),
        requests=lambda cfg, work, result, nb: vllm_requests(v, cfg, work, result, nb),
    )


# ---------------------------------------------------------------------------- driver


def bench(cfg: Config, work: Workload, sides: Sequence[Side]) -> list[Result]:
    """Warm every side up, then run the repeats round-robin (side by side, so that load
    from elsewhere on the machine hits both alike); keep each row's best."""
    results = [Result() for _ in sides]
    row = _batch_row(cfg)
    n_warm = min(50, len(work.prompts))
    warm_work = Workload(work.prompts[:n_warm], work.outputs[:n_warm], work.hashes[:n_warm])
    for side in sides:
        warm = Result()
        side.pairs(max(cfg.pairs // 10, 1), warm)
        side.batches(max(cfg.batches // 10, 1), cfg.batch_size, row, warm)
        side.requests(cfg, warm_work, warm, cfg.trace_c_blocks)
    for _ in range(cfg.repeats):
        for side, result in zip(sides, results, strict=True):
            side.pairs(cfg.pairs, result)
            side.batches(cfg.batches, cfg.batch_size, row, result)
            side.requests(cfg, work, result, cfg.trace_c_blocks)
    return results


# ---------------------------------------------------------------------------- report


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = f", load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""
    return (
        f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}{load}"
    )


def report(
    cfg: Config,
    kv: Result,
    vl: Result | None,
    vllm_version: str | None,
    batch_rows: Sequence[tuple[int, float, float]] = (),
) -> str:
    lines = [
        "kvguard pool-ops benchmark",
        f"machine: {_machine()}",
        f"baseline: vLLM {vllm_version}" if vl is not None else "baseline: vLLM skipped",
        (
            f"trace: (a) {cfg.pairs:,} pairs  (b) {cfg.batches:,} batches of "
            f"{cfg.batch_size}  (c) {cfg.requests:,} requests x {cfg.prompt_len}-token "
            f"prompt ({cfg.prefix_len} shared) + {cfg.decode_steps} decode steps, "
            f"block_size {cfg.block_size}; best of {cfg.repeats}; hashing {cfg.hashing}"
        ),
        "",
        f"{'row':<38}{'kvguard us':>12}{'vLLM us':>12}{'kvguard/vLLM':>14}",
    ]
    for row, ns in kv.per_op_ns.items():
        if vl is not None and row in vl.per_op_ns:
            base = vl.per_op_ns[row]
            lines.append(f"{row:<38}{ns / 1e3:>12.3f}{base / 1e3:>12.3f}{ns / base:>14.2f}")
        else:
            lines.append(f"{row:<38}{ns / 1e3:>12.3f}{'-':>12}{'-':>14}")

    def rate(r: Result) -> str:
        pct = 100.0 * r.hit_tokens / r.query_tokens if r.query_tokens else 0.0
        return f"{pct:.1f}% ({r.hit_tokens:,}/{r.query_tokens:,} prompt tokens)"

    lines.append("")
    lines.append(f"(c) prefix hit rate  kvguard: {rate(kv)}")
    if vl is not None:
        lines.append(f"(c) prefix hit rate  vLLM:    {rate(vl)}")
    else:
        lines.append("vLLM baseline skipped: vllm is not importable (or --no-vllm)")
    if batch_rows:
        lines += ["", *batch_report(cfg, batch_rows)]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> tuple[Config, bool]:
    d = Config()
    p = argparse.ArgumentParser(
        description="Time kvguard.BlockPool against the installed vLLM's BlockPool/KVCacheManager "
        "on one operation trace (microseconds per operation, best of N repeats)."
    )
    p.add_argument("--quick", action="store_true", help="seconds-long smoke run (for CI)")
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM baseline")
    p.add_argument("--pairs", type=int, help=f"(a) alloc+free pairs (default {d.pairs:,})")
    p.add_argument("--batches", type=int, help=f"(b) batches (default {d.batches:,})")
    p.add_argument("--batch-size", type=int, help=f"(b) blocks per batch (default {d.batch_size})")
    p.add_argument("--requests", type=int, help=f"(c) requests (default {d.requests:,})")
    p.add_argument("--prompt-len", type=int, help=f"(c) prompt tokens (default {d.prompt_len})")
    p.add_argument("--prefix-len", type=int, help=f"(c) shared prefix (default {d.prefix_len})")
    p.add_argument("--decode-steps", type=int, help=f"(c) decode steps (default {d.decode_steps})")
    p.add_argument("--block-size", type=int, help=f"tokens per block (default {d.block_size})")
    p.add_argument("--repeats", type=int, help=f"timed repeats, best kept (default {d.repeats})")
    p.add_argument(
        "--hashing",
        choices=("excluded", "included"),
        help="keep block hashing out of the timers on both sides (default) or time each "
        "side hashing with its own default hasher",
    )
    p.add_argument("--seed", type=int, help="token-id seed (default 0)")
    p.add_argument(
        "--batch-requests",
        type=lambda text: tuple(int(n) for n in text.split(",")),
        help="(d) requests a step, comma-separated (default "
        + ",".join(map(str, d.batch_requests))
        + ")",
    )
    p.add_argument("--batch-steps", type=int, help=f"(d) decode steps (default {d.batch_steps})")
    args = p.parse_args(argv)
    cfg = QUICK if args.quick else d
    overrides = {
        name: getattr(args, name)
        for name in (
            "pairs",
            "batches",
            "batch_size",
            "requests",
            "prompt_len",
            "prefix_len",
            "decode_steps",
            "block_size",
            "repeats",
            "hashing",
            "seed",
            "batch_requests",
            "batch_steps",
        )
        if getattr(args, name) is not None
    }
    cfg = replace(cfg, **overrides)
    if not 0 <= cfg.prefix_len <= cfg.prompt_len or min(cfg.pairs, cfg.batches, cfg.requests) < 1:
        p.error("need 0 <= --prefix-len <= --prompt-len and positive counts")
    if min(cfg.batch_steps, *cfg.batch_requests) < 2:
        p.error("--batch-steps and every --batch-requests must be at least 2")
    if min(cfg.batch_size, cfg.block_size, cfg.repeats, cfg.prompt_len) < 1:
        p.error("--batch-size, --block-size, --repeats and --prompt-len must be positive")
    return cfg, bool(args.no_vllm)


def main(argv: Sequence[str] | None = None) -> int:
    cfg, no_vllm = parse_args(argv)
    v = None if no_vllm else load_vllm()
    work = make_workload(cfg, cfg.requests)
    sides = [kvguard_side()] if v is None else [kvguard_side(), vllm_side(v)]
    results = bench(cfg, work, sides)
    kv = results[0]
    vl = results[1] if v is not None else None
    batch_rows = [(n, *batch_validation(cfg, n)) for n in cfg.batch_requests]
    print(report(cfg, kv, vl, v.version if v is not None else None, batch_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
