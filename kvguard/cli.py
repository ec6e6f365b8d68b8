"""The ``kvguard`` command line.

``kvguard simulate`` runs the fault-injection simulator (needs the ``sim`` extra:
:data:`SIM_INSTALL`). The simulator and torch are imported only inside the subcommand,
so ``kvguard --help`` and ``kvguard --version`` work with the core package alone.
``python -m kvguard`` is the same command.

Errors are one line on stderr, never a traceback (``KVGUARD_TRACEBACK=1`` shows the
traceback of a crash); the exit status says which kind of failure it was.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import NoReturn

from kvguard import __version__

EXIT_OK = 0
EXIT_ESCAPES = 1
"""A kvguard policy let corrupt KV reach a request: the finding the simulator exists for."""
EXIT_USAGE = 2
"""Bad arguments or settings (nothing was run)."""
EXIT_MISSING_DEPS = 3
"""The ``sim`` extra is not installed."""
EXIT_CRASH = 4
"""The simulator itself failed (a bug: please report it with ``KVGUARD_TRACEBACK=1``)."""
EXIT_INTERRUPTED = 130
"""Stopped by Ctrl-C (128 + SIGINT, as shells report it); no report was written."""
TRACEBACK_ENV = "KVGUARD_TRACEBACK"
SIM_INSTALL = "pip install torch==2.13.0 'kvguard[sim]'"
"""How to install the ``sim`` extra: torch pinned, since the extra's ``torch>=2.4``
alone would let pip pull the newest release, a multi-GB CUDA build."""
DEFAULT_RUN_TIME = "about 15 s on an idle CPU core"
"""How long the default scenario takes (measured: 15.5 s of CPU time, one core busy);
docs/simulator.md says the same."""
STARTED = "kvguard simulate: running"
"""How the line on stderr that says the run is under way starts (Ctrl-C from then on
stops it with :data:`EXIT_INTERRUPTED`)."""

EXIT_CODES_HELP = (
    f"exit status: {EXIT_OK} ok; {EXIT_ESCAPES} a kvguard policy let corruption escape; "
    f"{EXIT_USAGE} bad arguments; {EXIT_MISSING_DEPS} the 'sim' extra is missing; "
    f"{EXIT_CRASH} the simulator crashed; {EXIT_INTERRUPTED} interrupted (Ctrl-C)"
)


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def _fail(message: str) -> None:
    print(f"kvguard simulate: {message}", file=sys.stderr)


# Every option's type raises ArgumentTypeError, whose message argparse prints after the
# option's name; a bare ValueError would print the parser function's own name instead
# ("invalid _rate value").


def _integer(minimum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


_SIM_POLICIES = ("eager", "defer-zero-all", "kvguard", "kvguard-audit")
_SIM_FAULTS = ("kv", "logits", "rank", "kv-late", "tier")
_SIM_SCENARIOS = ("default", "ci")


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")  # refused below, with the same message
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(
            f"a fault rate is a number from 0 to 1 (0.2: one request in five), got {text!r}"
        )
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


def _add_simulate(sub: argparse._SubParsersAction[_Parser]) -> None:
    p = sub.add_parser(
        "simulate",
        epilog=EXIT_CODES_HELP,
        help="fault-injection simulator: NaN KV through a prefix cache, with and without kvguard",
        description=(
            "Run a tiny transformer over a real paged KV cache managed by kvguard.BlockPool, "
            "inject faults (NaN KV, NaN logits, rank failures), and compare policies against "
            "a fault-free run of the same workload. Prints a table per policy and writes "
            "report.json and sweep.png to --out. Exits 1 if a kvguard policy lets any "
            "corruption escape (other failures have exit codes of their own, below)."
        ),
    )
    p.add_argument(
        "--scenario",
        choices=_SIM_SCENARIOS,
        default="default",
        help=f"named preset: 'default' (the README's: {DEFAULT_RUN_TIME}) or 'ci' (a smaller "
        "one for tests) (default: default)",
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
        "attention read the KV: only the audit catches it), tier (a CPU-tier copy rots once "
        "stored: only a load verified by its seal catches it) (default: kv,logits,rank)",
    )
    p.add_argument(
        "--sweep",
        type=_rates,
        default=None,
        help="comma-separated fault rates for the plot (default: the scenario's; '' for none)",
    )
    p.add_argument(
        "--seed",
        type=_integer(),
        default=None,
        help="workload and fault seed (default: the scenario's)",
    )
    p.add_argument(
        "--requests",
        type=_integer(1),
        default=None,
        help="number of requests (default: the scenario's)",
    )
    p.add_argument(
        "--num-blocks",
        type=_integer(1),
        default=None,
        help="GPU KV blocks in the pool (default: the scenario's)",
    )
    p.add_argument(
        "--tier-blocks",
        type=_integer(0),
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
        _fail(f"needs the 'sim' extra ({exc.name} is missing): {SIM_INSTALL}")
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
    problems = scenario.problems()
    if problems:
        _fail("; ".join(problems))
        return EXIT_USAGE
    need, have = scenario.memory_bytes(), _available_memory()
    if have is not None and need > have:
        _fail(
            f"this run needs about {need / 2**30:.1f} GiB and {have / 2**30:.1f} GiB is "
            "available; lower --num-blocks, --tier-blocks or --requests"
        )
        return EXIT_USAGE
    problem = _unwritable(args.out)
    if problem:
        _fail(f"cannot write the report to --out {args.out!r}: {problem}")
        return EXIT_USAGE
    policies = [POLICIES[name] for name in args.policies]
    progress = Progress(scenario, len(policies), enabled=not args.no_progress)
    try:
        # Inside the try: from this line on, Ctrl-C ends the run with EXIT_INTERRUPTED
        # (tests wait for it before they send SIGINT).
        print(
            f"{STARTED} scenario {scenario.name!r}: {progress.total} runs of "
            f"{scenario.num_requests} requests each; Ctrl-C stops it",
            file=sys.stderr,
            flush=True,
        )
        with progress:
            report = simulate(
                scenario,
                policies,
                sweep=scenario.sweep,
                on_run=progress.run,
                on_step=progress.step,
            )
    except KeyboardInterrupt:
        _fail(f"interrupted during {progress.current!r}: no report written")
        return EXIT_INTERRUPTED
    except Exception as exc:
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        _fail(
            f"crashed during {progress.current!r}: {type(exc).__name__}: {exc} "
            f"(rerun with {TRACEBACK_ENV}=1 for the traceback)"
        )
        return EXIT_CRASH
    print(format_report(report))
    json_path = os.path.join(args.out, "report.json")
    try:
        write_json(report, json_path)
    except OSError as exc:  # checked writable before the run: the disk filled, say
        _fail(f"cannot write {json_path}: {exc.strerror or exc}")
        return EXIT_CRASH
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


def _available_memory() -> int | None:
    """Bytes of memory available to a new run (Linux's MemAvailable), if known."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _unwritable(out: str) -> str | None:
    """Why the report cannot be written to directory ``out`` (None: it can), found
    before the run by creating it and a scratch file in it."""
    if os.path.exists(out) and not os.path.isdir(out):
        return "it is a file, not a directory; give a directory (created if missing)"
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except NotADirectoryError:
        return "part of its path is a file, not a directory; give a directory"
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvguard",
        description="kvguard: a KV-cache block pool that shares or offloads KV only after "
        "it was validated.",
    )
    parser.add_argument("--version", action="version", version=f"kvguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_simulate(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except KeyboardInterrupt:  # (an import in an argument type, for instance)
        return EXIT_INTERRUPTED
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        result: int = func(args)
    except KeyboardInterrupt:
        _fail("interrupted: no report written")
        return EXIT_INTERRUPTED
    return result


if __name__ == "__main__":
    sys.exit(main())
