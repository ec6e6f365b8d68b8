"""The ``kvguard`` command line.

``kvguard simulate`` runs the fault-injection simulator (needs the ``sim`` extra:
``pip install 'kvguard[sim]'``). The simulator and torch are imported only inside the
subcommand, so ``kvguard --help`` works with the core package alone.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

EXIT_OK = 0
EXIT_ESCAPES = 1
"""A kvguard policy let corrupt KV reach a request (or the engine misbehaved)."""
EXIT_USAGE = 2
EXIT_MISSING_DEPS = 3

_SIM_POLICIES = ("eager", "defer-zero-all", "kvguard", "kvguard-audit")
_SIM_FAULTS = ("kv", "logits", "rank", "kv-late")
_SIM_SCENARIOS = ("default", "ci")


def _rate(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a fault rate is in [0, 1], got {text}")
    return value


def _csv(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated subset of {', '.join(choices)}; got {text!r}"
            )
        return items

    return parse


def _rates(text: str) -> tuple[float, ...]:
    return tuple(_rate(x) for x in text.split(",") if x.strip())


def _add_simulate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "simulate",
        help="fault-injection simulator: NaN KV through a prefix cache, with and without kvguard",
        description=(
            "Run a tiny transformer over a real paged KV cache managed by kvguard.BlockPool, "
            "inject faults (NaN KV, NaN logits, rank failures), and compare policies against "
            "a fault-free run of the same workload. Prints a table per policy and writes "
            "report.json and sweep.png to --out. Exits 1 if a kvguard policy lets any "
            "corruption escape."
        ),
    )
    p.add_argument(
        "--scenario",
        choices=_SIM_SCENARIOS,
        default="default",
        help="named preset: 'default' (the README's, under a minute on 2 CPU cores) or "
        "'ci' (a smaller one for tests) (default: default)",
    )
    p.add_argument(
        "--policies",
        type=_csv(_SIM_POLICIES),
        default=_SIM_POLICIES,
        help="comma-separated policies to compare: eager (vLLM 0.33: publish at schedule "
        "time, no abort), defer-zero-all (vLLM PR #50283), kvguard (defer, abort alone, zero "
        "suspect blocks, recover rank failures), kvguard-audit (plus a KV audit before "
        "publication) (default: all four)",
    )
    p.add_argument(
        "--fault-rate",
        type=_rate,
        default=None,
        help="fraction of requests given one planned fault (default: the scenario's)",
    )
    p.add_argument(
        "--faults",
        type=_csv(_SIM_FAULTS),
        default=None,
        help="comma-separated fault kinds: kv (NaN K/V in the forward pass), logits (NaN "
        "logits), rank (a rank failure garbles the step's KV), kv-late (NaN stored after "
        "attention read the KV: only the audit catches it) (default: kv,logits,rank)",
    )
    p.add_argument(
        "--sweep",
        type=_rates,
        default=None,
        help="comma-separated fault rates for the plot (default: the scenario's; '' for none)",
    )
    p.add_argument(
        "--seed", type=int, default=None, help="workload and fault seed (default: the scenario's)"
    )
    p.add_argument(
        "--requests", type=int, default=None, help="number of requests (default: the scenario's)"
    )
    p.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="GPU KV blocks in the pool (default: the scenario's)",
    )
    p.add_argument(
        "--tier-blocks",
        type=int,
        default=None,
        help="CPU offload tier capacity in blocks, 0 for none (default: the scenario's)",
    )
    sched = p.add_mutually_exclusive_group()
    sched.add_argument(
        "--async",
        dest="async_scheduling",
        action="store_true",
        default=None,
        help="async scheduling: a step is validated one step later (the scenarios' default)",
    )
    sched.add_argument(
        "--sync",
        dest="async_scheduling",
        action="store_false",
        help="sync scheduling: a step is validated before the next one is scheduled",
    )
    p.add_argument(
        "--check-invariants",
        action="store_true",
        default=None,
        help="run BlockPool.check_invariants after every pool mutation (slow)",
    )
    p.add_argument(
        "--out",
        default="kvguard-report",
        help="directory for report.json and sweep.png, created if missing "
        "(default: kvguard-report)",
    )
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (and matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_simulate)


def _simulate(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401

        from kvguard.sim import (
            POLICIES,
            SCENARIOS,
            FaultKind,
            Progress,
            format_report,
            simulate,
            write_json,
        )
    except ImportError as exc:
        print(
            f"kvguard simulate needs the 'sim' extra ({exc.name} is missing): "
            "pip install 'kvguard[sim]'",
            file=sys.stderr,
        )
        return EXIT_MISSING_DEPS
    scenario = SCENARIOS[args.scenario].with_overrides(
        fault_rate=args.fault_rate,
        fault_kinds=tuple(FaultKind(k) for k in args.faults) if args.faults else None,
        sweep=args.sweep,
        seed=args.seed,
        num_requests=args.requests,
        num_blocks=args.num_blocks,
        tier_blocks=args.tier_blocks,
        async_scheduling=args.async_scheduling,
        check_invariants=args.check_invariants,
    )
    policies = [POLICIES[name] for name in args.policies]
    os.makedirs(args.out, exist_ok=True)
    with Progress(scenario, len(policies), enabled=not args.no_progress) as progress:
        report = simulate(
            scenario,
            policies,
            sweep=scenario.sweep,
            on_run=progress.run,
            on_step=progress.step,
        )
    print(format_report(report))
    json_path = os.path.join(args.out, "report.json")
    write_json(report, json_path)
    print(f"\nwrote {json_path}", end="")
    if not args.no_plot and report.sweep:
        try:
            from kvguard.sim.plot import write_plot

            png_path = os.path.join(args.out, "sweep.png")
            write_plot(report, png_path)
            print(f" and {png_path}", end="")
        except ImportError:
            print(" (no plot: pip install matplotlib)", end="")
    print()
    bad = report.guarded_escapes
    if bad:
        print(f"FAIL: kvguard policies delivered {bad} corrupted outputs", file=sys.stderr)
        return EXIT_ESCAPES
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvguard",
        description="kvguard: a KV-cache block pool that shares or offloads KV only after "
        "it was validated.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_simulate(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return EXIT_USAGE
    result: int = func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
