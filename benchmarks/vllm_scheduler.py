"""Stock vLLM's scheduler vs kvguard's guarded scheduler on one synthetic trace.

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
        [--output-tokens 8 64] [--offload [offloading|simple-cpu|simple-cpu-lazy|lmcache]]
        [--seal]

``--output-tokens MIN MAX`` sets the range each request's output length is drawn from
(default 8..63: short answers, so admissions, prefill chunks and frees -- the guard's
per-block work -- weigh more than in a decode-heavy serving mix).

``--groups full,sliding`` runs a model with those KV cache groups instead of one
full-attention group (``full``, ``sliding``, ``chunked``, ``rswa``: a model's window or
local-chunk frees go through the guard's window wrapper; ``--window`` sets their size
in tokens, default 256; ``mamba``: a hybrid model's Mamba state group, vLLM's ``align``
mode, whose boundary checkpoints the guard holds back).

``--offload`` gives both schedulers vLLM's CPU offloading (``OffloadingConnector``; the
guarded side runs kvguard's ``GuardedOffloadingConnector``, its offload gate); the
"workers" finish every transfer job with the step's output. ``--offload simple-cpu``
(``simple-cpu-lazy``) gives them vLLM's ``SimpleCPUOffloadConnector`` in eager (lazy)
mode instead, the guarded side kvguard's ``GuardedSimpleCPUOffloadConnector`` (what the
plugin substitutes for it), one full-attention group, a CPU tier four times the GPU
pool; the "workers" report every store event and every load event done with the output
of the step that sent it. ``--offload lmcache`` gives them vLLM's ``LMCacheConnectorV1``
with LMCache's own scheduler side (the guarded side kvguard's
``GuardedLMCacheConnectorV1``; needs the ``lmcache`` package and vLLM 0.33, the last
series LMCache 0.5.6 drives): the "workers" keep the chunk hashes each step's metadata
asks them to save, and LMCache's lookups are answered from them. Each prints what both
sides stored and loaded per round.

``--revisit P``: each request of the trace's second half repeats, with probability P,
the prompt and output length of the request half a trace before it. Under ``--offload``
the GPU pool has evicted most of those blocks by then and both sides load them back from
the CPU tier (OffloadingConnector's tier then also holds four times the GPU pool, not
256 chunks); without it the trace loads nothing.

``--spec-tokens K`` gives both schedulers speculative decoding with K draft tokens (vLLM's
ngram method; ngram_gpu under async scheduling; the guarded side with ``KVGUARD_GUARD=1``,
which lets it take drafts): the "workers" propose K drafts for every decoding request
and accept a number of them that depends only on the request and its length, so both
sides see the same acceptances.

``--seal`` switches seals on on the guarded side (``{"kvguard": {"seal": true}}``): each
step sends its fills to be sealed, the "workers" return a seal per block with the
counts (not timed), the pool records them, and with ``--offload`` each load carries its
blocks' seals to the workers (the scheduler side of seals; the workers' sealing is
``vllm_engine.py --seal``'s).

``--control`` runs stock vLLM on both sides: the ratio this method reports for two
identical schedulers, i.e. its own bias and noise floor on the machine at hand.
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
import zlib
from typing import Any

os.environ.setdefault("VLLM_COMPUTE_NANS_IN_LOGITS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import torch
    import vllm
    from vllm.config import KVTransferConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
    from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata
    from vllm.v1.structured_output import StructuredOutputManager

    from kvguard.adapters.vllm.scheduler.guarded import GuardedAsyncScheduler, GuardedScheduler
    from kvguard.adapters.vllm.workers.audit import with_seals
    from kvguard.adapters.vllm.workers.seals import SEAL_FIELD
    from tests.vllm.harness import (
        BLOCK,
        LMCacheLookupStub,
        connector_output,
        lmcache_hit,
        make_request,
        make_scheduler,
        make_vllm_config,
        model_output,
        ngram_speculation,
        offloading_metadata,
        tensor_backed_kv_cache_config,
        transfer_config,
    )

_clock = time.perf_counter

OFFLOAD_MODES = {
    "offloading": "OffloadingConnector",
    "simple-cpu": "SimpleCPUOffloadConnector, eager",
    "simple-cpu-lazy": "SimpleCPUOffloadConnector, lazy",
    "lmcache": "LMCacheConnectorV1",
}
"""``--offload``'s choices: the connector both sides run (bare ``--offload``: the first)."""


def offloading_config(guarded: bool, args: argparse.Namespace, num_blocks: int) -> Any:
    """``--offload``'s OffloadingConnector (kvguard's on the guarded side): the
    harness's CPU tier (256 chunks of one block), or with ``--revisit`` one of four times
    ``num_blocks`` chunks, as SimpleCPU's, where what the GPU pool evicted stays a while."""
    name = "GuardedOffloadingConnector" if guarded else "OffloadingConnector"
    if not args.revisit:
        return transfer_config(name)
    # (A chunk of one 128-byte block takes vLLM's alignment: 4 KiB.)
    return transfer_config(name, cpu_bytes=4 * num_blocks * CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT)


def simple_cpu_scheduler(guarded: bool, args: argparse.Namespace, num_blocks: int) -> Any:
    """A scheduler with SimpleCPU offloading (``--offload simple-cpu[-lazy]``): stock
    (vLLM's scheduler and ``SimpleCPUOffloadConnector``) or guarded (kvguard's scheduler
    and ``GuardedSimpleCPUOffloadConnector``). Its KV cache config describes its tensor,
    which SimpleCPU sizes its CPU tier from; both sides get a tier of four times
    ``num_blocks`` blocks (``num_cpu_blocks``, which the guarded class named directly
    needs from vLLM 0.33 on; 0.32 sizes the tier by the bytes alone, the same on both
    sides): what the GPU pool evicted stays there for a while (``--revisit``)."""
    cpu_blocks = 4 * num_blocks
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    name = "GuardedSimpleCPUOffloadConnector" if guarded else "SimpleCPUOffloadConnector"
    connector = KVTransferConfig(
        kv_connector=name,
        kv_role="kv_both",
        kv_connector_module_path=("kvguard.adapters.vllm.exits.simple_cpu" if guarded else None),
        kv_connector_extra_config={
            "cpu_bytes_to_use": spec.page_size_bytes * cpu_blocks,
            "num_cpu_blocks": cpu_blocks,
            "lazy_offload": args.offload == "simple-cpu-lazy",
        },
    )
    vllm_config = make_vllm_config(
        async_scheduling=args.async_scheduling,
        num_blocks=num_blocks,
        max_num_batched_tokens=512,
        max_num_seqs=64,
        kvguard=guard_settings(guarded, args),
        kv_transfer_config=connector,
    )
    if guarded:
        cls: type = GuardedAsyncScheduler if args.async_scheduling else GuardedScheduler
    else:
        cls = AsyncScheduler if args.async_scheduling else Scheduler
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=tensor_backed_kv_cache_config(spec, num_blocks),
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
        log_stats=True,
    )


class LMCacheChunks(LMCacheLookupStub):
    """LMCache's store as its lookups see it: the chunk hashes (LMCache's own, from its
    scheduler side's token database) the workers were asked to save; LMCache's lookup
    client, answered from them."""

    def __init__(self, token_database: Any) -> None:
        self.db = token_database
        self.saved: set[int] = set()
        self.loaded_tokens = 0

    def save(self, m: Any) -> int:
        """Save what one ``ReqMeta`` asks for; returns how many chunks."""
        skip = m.save_spec.skip_leading_tokens // self.db.chunk_size * self.db.chunk_size
        new = [h for start, _, h in self.db.process_tokens(m.token_ids, make_key=False)]
        new = new[skip // self.db.chunk_size :]
        self.saved.update(new)
        return len(new)

    def lookup(self, token_ids: Any, lookup_id: str, request_configs: Any = None) -> int:
        return lmcache_hit(self.db, token_ids, self.saved)


def lmcache_scheduler(guarded: bool, args: argparse.Namespace, num_blocks: int) -> Any:
    """A scheduler with LMCache (``--offload lmcache``): LMCache's lookups answered by
    :class:`LMCacheChunks` (which the "workers" fill)."""
    connector = KVTransferConfig(
        kv_connector="GuardedLMCacheConnectorV1" if guarded else "LMCacheConnectorV1",
        kv_connector_module_path="kvguard.adapters.vllm" if guarded else None,
        kv_role="kv_both",
        kv_connector_extra_config={"lmcache.chunk_size": 4 * BLOCK},
    )
    scheduler = make_scheduler(
        guarded=guarded,
        num_blocks=num_blocks,
        max_num_batched_tokens=512,
        max_num_seqs=64,
        kvguard=guard_settings(guarded, args),
        kv_transfer_config=connector,
    )
    impl = scheduler.connector._lmcache_engine
    impl.lookup_client.close()  # (its sockets: no LMCache worker answers here)
    impl._manager._lookup_client = LMCacheChunks(impl.lookup_client.token_database)
    return scheduler


def guard_settings(guarded: bool, args: argparse.Namespace) -> dict[str, Any]:
    """The guarded side's kvguard settings (``--seal``: seals on)."""
    settings: dict[str, Any] = {"check_invariants": False}
    if guarded and args.seal:
        settings["seal"] = True
    return settings


class Side:
    """One scheduler and the time spent inside its schedule() / update_from_output()."""

    def __init__(self, guarded: bool, args: argparse.Namespace) -> None:
        num_blocks = args.blocks or 2048 * len(args.groups)
        self.offload: str | None = args.offload
        if self.offload in ("simple-cpu", "simple-cpu-lazy"):
            self.scheduler: Any = simple_cpu_scheduler(guarded, args, num_blocks)
        elif self.offload == "lmcache":
            self.scheduler = lmcache_scheduler(guarded, args, num_blocks)
        else:
            self.scheduler = make_scheduler(
                guarded=guarded,
                async_scheduling=args.async_scheduling,
                num_blocks=num_blocks,
                max_num_batched_tokens=512,
                max_num_seqs=64,
                kvguard=guard_settings(guarded, args),
                groups=args.groups,
                window=args.window,
                kv_transfer_config=(
                    offloading_config(guarded, args, num_blocks) if self.offload else None
                ),
                speculative_config=(
                    ngram_speculation(args.spec_tokens, async_scheduling=args.async_scheduling)
                    if args.spec_tokens
                    else None
                ),
            )
        self.spec_tokens = args.spec_tokens
        self.drafts_accepted = self.drafts_scheduled = 0
        self.store_jobs = self.load_jobs = 0
        self.stored_blocks = self.loaded_blocks = 0  # (SimpleCPU: blocks of those events)
        self.pending: list[Any] = []
        self.step_times: list[float] = []
        self.schedule_times: list[float] = []
        self.depth = 2 if args.async_scheduling else 1

    def step(self) -> None:
        s = self.scheduler
        start = _clock()
        so = s.schedule()
        elapsed = _clock() - start
        self.schedule_times.append(elapsed)
        self.pending.append(so)
        if len(self.pending) == self.depth:
            done = self.pending.pop(0)
            mro = self.worker_output(done)  # the "worker": not timed
            start = _clock()
            s.update_from_output(done, mro)
            elapsed += _clock() - start
            if self.spec_tokens and self.depth == 1:
                self.propose_drafts()  # the engine hands the drafts over: not timed
        self.step_times.append(elapsed)

    def propose_drafts(self) -> None:
        """Sync: K drafts for every decoding request (what ngram proposes is irrelevant
        here: ``spec_output`` decides the acceptances)."""
        s = self.scheduler
        req_ids = [
            r for r, q in s.requests.items() if not q.is_finished() and not q.is_prefill_chunk
        ]
        s.update_draft_token_ids(DraftTokenIds(req_ids, [[5] * self.spec_tokens for _ in req_ids]))

    def spec_output(self, scheduler_output: Any) -> Any:
        """A step's output under speculative decoding: for each request whose step
        samples, some of its drafts accepted (a function of the request and its length,
        the same on both sides) and one bonus token; no NaN."""
        s = self.scheduler
        out = model_output(s, scheduler_output)
        rows = out.sampled_token_ids
        for i, req_id in enumerate(out.req_ids):
            request = s.requests.get(req_id)
            if not rows[i] or request is None:
                continue
            drafts = len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
            key = f"{req_id}:{request.num_output_tokens}".encode()
            accepted = zlib.crc32(key) % (drafts + 1)
            self.drafts_scheduled += drafts
            self.drafts_accepted += accepted
            rows[i] = [5] * (accepted + 1)
        return out

    def worker_output(self, scheduler_output: Any) -> Any:
        """What the workers send back for a step (with seals on, a seal for each block
        the step sent to be sealed)."""
        out = self.unsealed_output(scheduler_output)
        blocks = getattr(scheduler_output, SEAL_FIELD, None)
        if blocks:
            seals = {b: b * 2654435761 % (1 << 61) for ids in blocks.values() for b in ids}
            out.num_nans_in_logits = with_seals(out.num_nans_in_logits, seals)
        return out

    def unsealed_output(self, scheduler_output: Any) -> Any:
        """What the workers send back for a step; with offloading, every transfer job
        of the step done (the loading requests' KV received)."""
        s = self.scheduler
        if self.spec_tokens:
            return self.spec_output(scheduler_output)
        if not self.offload:
            return model_output(s, scheduler_output)
        if self.offload == "lmcache":
            return self.lmcache_output(scheduler_output)
        if self.offload != "offloading":
            return self.simple_cpu_output(scheduler_output)
        meta = offloading_metadata(scheduler_output)
        self.store_jobs += len(meta.store_jobs)
        self.load_jobs += len(meta.load_jobs)
        return connector_output(
            s,
            scheduler_output,
            completed=[*meta.store_jobs, *meta.load_jobs],
            recved=[job.req_id for job in meta.load_jobs.values()],
        )

    def simple_cpu_output(self, scheduler_output: Any) -> Any:
        """SimpleCPU's workers: the step's store event done (the copy runs after the
        step's forward) and its load event's requests received, both reported in the
        step's output."""
        meta = scheduler_output.kv_connector_metadata
        out = model_output(self.scheduler, scheduler_output)
        done: dict[int, int] = {}
        if meta.store_event >= 0:
            done[meta.store_event] = 1
            self.store_jobs += 1
            self.stored_blocks += len(meta.store_gpu_blocks)
        received = meta.load_event_to_reqs.get(meta.load_event, []) if meta.load_event >= 0 else []
        if received:
            self.load_jobs += 1
            self.loaded_blocks += len(meta.load_gpu_blocks)
        out.kv_connector_output = KVConnectorOutput(
            finished_recving=set(received) or None,
            kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(completed_store_events=done),
        )
        return out

    def lmcache_output(self, scheduler_output: Any) -> Any:
        """LMCache's workers: each save the step's metadata asks for is kept (the
        chunks' hashes), each load done; a finished request the guarded side kept for
        its last save is reported done sending."""
        meta = scheduler_output.kv_connector_metadata
        chunks = self.scheduler.connector._lmcache_engine.lookup_client
        for m in meta.requests:
            if m.save_spec is not None and m.save_spec.can_save:
                self.store_jobs += 1
                self.stored_blocks += chunks.save(m)
            if m.load_spec is not None and m.load_spec.can_load:
                self.load_jobs += 1
                self.loaded_blocks += m.load_spec.lmcache_cached_tokens
        out = model_output(self.scheduler, scheduler_output)
        finishing = getattr(meta, "kvguard_finish_after_save", None)
        if finishing:
            out.kv_connector_output = KVConnectorOutput(finished_sending=set(finishing))
        return out


def run_round(args: argparse.Namespace, repeat: int) -> tuple[Side, Side]:
    """One pass of the trace through both schedulers (stock, guarded)."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(50_000) for _ in range(4 * BLOCK)] for _ in range(8)]
    arrivals: dict[int, list[tuple[str, list[int], int]]] = {}
    requests: list[tuple[list[int], int]] = []
    half = args.requests // 2
    for i in range(args.requests):
        prompt = rng.choice(prefixes) + [
            rng.randrange(50_000) for _ in range(rng.randrange(8, 300))
        ]
        max_tokens = rng.randrange(*args.output_tokens)
        if args.revisit and i >= half and rng.random() < args.revisit:
            prompt, max_tokens = requests[i - half]  # (drawn only with --revisit)
        requests.append((prompt, max_tokens))
        arrivals.setdefault(i // 4, []).append((f"r{i}", prompt, max_tokens))
    stock, guarded = Side(False, args), Side(not args.control, args)
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
    return stock, guarded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--blocks", type=int, default=None, help="default: 2048 per group")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument(
        "--output-tokens",
        type=int,
        nargs=2,
        default=(8, 64),
        metavar=("MIN", "MAX"),
        help="output length of each request: drawn from [MIN, MAX)",
    )
    parser.add_argument(
        "--groups",
        type=lambda text: tuple(text.split(",")),
        default=("full",),
        help="KV cache groups of the model, comma-separated (full, sliding, chunked, rswa, mamba)",
    )
    parser.add_argument("--window", type=int, default=256, help="window / chunk, in tokens")
    parser.add_argument(
        "--offload",
        nargs="?",
        const="offloading",
        default=None,
        choices=OFFLOAD_MODES,
        help="vLLM's CPU offloading on both sides (kvguard's gate on the guarded one): "
        "OffloadingConnector (the default), or SimpleCPUOffloadConnector in eager or lazy mode",
    )
    parser.add_argument(
        "--revisit",
        type=float,
        default=0.0,
        metavar="P",
        help="each request of the trace's second half repeats the prompt of the request "
        "half a trace before it with probability P (with --offload: loads from the CPU tier)",
    )
    parser.add_argument(
        "--spec-tokens",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding with K draft tokens on both sides (ngram)",
    )
    parser.add_argument(
        "--seal", action="store_true", help="seals on on the guarded side (scheduler side)"
    )
    parser.add_argument(
        "--control", action="store_true", help="stock vLLM on both sides (the method's bias)"
    )
    args = parser.parse_args()
    if not 1 <= args.output_tokens[0] < args.output_tokens[1]:
        parser.error("--output-tokens needs 1 <= MIN < MAX")
    if not 0 <= args.revisit <= 1:
        parser.error("--revisit needs 0 <= P <= 1")
    if args.seal and args.async_scheduling:
        parser.error("--seal needs synchronous scheduling (the guard refuses seals under async)")
    if args.spec_tokens and args.offload:
        parser.error("--spec-tokens and --offload are not combined")
    if args.offload == "lmcache":
        os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")  # (a line per request)
        os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
        if args.groups != ("full",) or args.async_scheduling:
            parser.error("--offload lmcache runs one full-attention group, sync scheduling")
    if args.offload in ("simple-cpu", "simple-cpu-lazy") and args.groups != ("full",):
        parser.error(f"--offload {args.offload} runs one full-attention group (no --groups)")
    if args.spec_tokens:
        # The guarded scheduler takes drafts only where the plugin makes vLLM's workers
        # count NaNs per request (docs/vllm.md, "Speculative decoding"): what it does.
        from kvguard.adapters.vllm.workers import nans as worker_nans

        os.environ["KVGUARD_GUARD"] = "1"
        worker_nans.install()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, vllm {vllm.__version__}, "
        f"{'async' if args.async_scheduling else 'sync'} scheduling, "
        f"output tokens {args.output_tokens[0]}..{args.output_tokens[1] - 1}, "
        f"KV cache groups {'+'.join(args.groups)}"
        + (f", CPU offloading ({OFFLOAD_MODES[args.offload]})" if args.offload else "")
        + (f", second half revisits the first's prompts (P={args.revisit})" if args.revisit else "")
        + (f", speculative decoding ({args.spec_tokens} draft tokens)" if args.spec_tokens else "")
        + (", seals on (the guarded side)" if args.seal else "")
        + (", CONTROL RUN: stock vLLM on both sides" if args.control else "")
    )
    # The second side's name in the report ("stock#2" in a control run).
    name = "stock#2" if args.control else "guarded"
    stock_rounds: list[Side] = []
    guard_rounds: list[Side] = []
    for r in range(args.rounds):
        stock, guard = run_round(args, r)
        stock_rounds.append(stock)
        guard_rounds.append(guard)
        s_total, g_total = sum(stock.step_times), sum(guard.step_times)
        print(
            f"round {r}: {len(stock.step_times)} steps, "
            f"stock {s_total / len(stock.step_times) * 1e6:7.1f} us/step, "
            f"{name} {g_total / len(guard.step_times) * 1e6:7.1f} us/step, "
            f"ratio {g_total / s_total:.3f}"
        )

    # Every round replays the same trace, so step t does the same work in each: the
    # fastest of its R timings is that step's cost without the machine's noise
    # (interrupts, neighbours, frequency changes), on either side.
    def best(sides: list[Side], attr: str) -> list[float]:
        return [min(times) for times in zip(*(getattr(s, attr) for s in sides), strict=True)]

    best_stock, best_guard = best(stock_rounds, "step_times"), best(guard_rounds, "step_times")
    sched_stock = best(stock_rounds, "schedule_times")
    sched_guard = best(guard_rounds, "schedule_times")
    steps = len(best_stock)
    pairs = zip(stock_rounds, guard_rounds, strict=True)
    median = statistics.median(sum(g.step_times) / sum(s.step_times) for s, g in pairs)
    print(f"stock vLLM   {sum(best_stock) / steps * 1e6:9.1f} us/step (each step's best)")
    print(f"{name:<12} {sum(best_guard) / steps * 1e6:9.1f} us/step (each step's best)")
    print(
        f"  schedule():           stock {sum(sched_stock) / steps * 1e6:7.1f}, "
        f"{name} {sum(sched_guard) / steps * 1e6:7.1f} us/step, "
        f"ratio {sum(sched_guard) / sum(sched_stock):.3f}"
    )
    upd_stock = sum(best_stock) - sum(sched_stock)
    upd_guard = sum(best_guard) - sum(sched_guard)
    print(
        f"  update_from_output(): stock {upd_stock / steps * 1e6:7.1f}, "
        f"{name} {upd_guard / steps * 1e6:7.1f} us/step, ratio {upd_guard / upd_stock:.3f} "
        "(approx.: step best minus schedule best)"
    )
    if args.offload == "offloading":  # the same trace each round: the last one's counts
        stock, guard = stock_rounds[-1], guard_rounds[-1]
        print(
            f"offloading, per round: stock {stock.store_jobs} store / {stock.load_jobs} load "
            f"jobs, {name} {guard.store_jobs} / {guard.load_jobs}"
        )
    elif args.offload == "lmcache":
        stock, guard = stock_rounds[-1], guard_rounds[-1]
        print(
            f"LMCache, per round: stock {stock.stored_blocks} chunks saved / "
            f"{stock.loaded_blocks} tokens loaded ({stock.store_jobs} saves / "
            f"{stock.load_jobs} loads), {name} {guard.stored_blocks} / {guard.loaded_blocks} "
            f"({guard.store_jobs} / {guard.load_jobs})"
        )
    elif args.offload:
        stock, guard = stock_rounds[-1], guard_rounds[-1]
        print(
            f"SimpleCPU offloading, per round: stock {stock.stored_blocks} blocks stored / "
            f"{stock.loaded_blocks} loaded ({stock.store_jobs} / {stock.load_jobs} events), "
            f"{name} {guard.stored_blocks} / {guard.loaded_blocks} "
            f"({guard.store_jobs} / {guard.load_jobs})"
        )
    if args.spec_tokens:
        stock, guard = stock_rounds[-1], guard_rounds[-1]
        print(
            f"drafts, per round: stock {stock.drafts_accepted} of {stock.drafts_scheduled} "
            f"accepted, {name} {guard.drafts_accepted} of {guard.drafts_scheduled}"
        )
    if args.seal:
        sealed = guard_rounds[-1].scheduler.kvguard_stats()
        print(
            f"seals, per round: {sealed['blocks_sealed']} blocks sealed, "
            f"{sealed.get('offload_loads_refused', 0) + sealed.get('lmcache_loads_refused', 0)} "
            "loads refused"
        )
    print(f"median of per-round ratios: {median:.3f}")
    goal = "(the method's bias: ideally 1.000)" if args.control else "(goal <= 1.02)"
    print(f"ratio {name}/stock = {sum(best_guard) / sum(best_stock):.3f} {goal}")


if __name__ == "__main__":
    main()
