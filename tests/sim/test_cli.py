"""The ``kvguard`` command line: help, a small end-to-end run, exit status."""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import kvguard
from kvguard.cli import (
    DEFAULT_RUN_TIME,
    EXIT_CRASH,
    EXIT_ESCAPES,
    EXIT_INTERRUPTED,
    EXIT_MISSING_DEPS,
    EXIT_OK,
    EXIT_USAGE,
    SIM_INSTALL,
    STARTED,
    TRACEBACK_ENV,
    build_parser,
    main,
)

ROOT = Path(__file__).resolve().parent.parent.parent


def _simulate_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    parser: argparse.ArgumentParser = sub.choices["simulate"]  # type: ignore[index]
    return parser


def test_every_simulate_option_is_documented() -> None:
    for action in _simulate_parser()._actions:
        assert action.help, f"option {action.option_strings} has no help"


def test_version_and_python_dash_m() -> None:
    """``kvguard --version``, and ``python -m kvguard`` is the same command."""
    version = _kvguard("--version", module="kvguard")
    assert (version.returncode, version.stdout.strip()) == (0, f"kvguard {kvguard.__version__}")
    bad = _kvguard("simulate", "--requests", "0", module="kvguard")
    assert bad.returncode == EXIT_USAGE
    assert bad.stderr.startswith("kvguard simulate: error: argument --requests:"), bad.stderr


def test_help_names_the_vllm_series_it_describes() -> None:
    """vLLM's behaviour differs between series: the help never says just "vLLM"."""
    text = build_parser().format_help() + _simulate_parser().format_help()
    assert "vLLM 0.33" in text
    bare = re.findall(r"vLLM(?! 0\.\d+| PR #\d+)\W*\w*", " ".join(text.split()))
    assert not bare, bare


def test_help_and_docs_give_the_same_run_time() -> None:
    help_text = " ".join(_simulate_parser().format_help().split())
    assert f"'default' (the README's: {DEFAULT_RUN_TIME})" in help_text
    assert DEFAULT_RUN_TIME in (ROOT / "docs" / "simulator.md").read_text()


def test_missing_sim_extra_says_how_to_install_it_with_torch_pinned(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['torch'] = None  # import torch now fails\n"
        "from kvguard.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, *CI_RUN, "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == EXIT_MISSING_DEPS, run.stderr
    assert run.stderr == (
        f"kvguard simulate: needs the 'sim' extra (torch is missing): {SIM_INSTALL}\n"
    )
    # The torch the README's quick start pins (a range would pull a CUDA build).
    torch_pin = re.search(r"torch==[\d.]+ ", SIM_INSTALL)
    assert torch_pin is not None and torch_pin.group() in (ROOT / "README.md").read_text()
    assert SIM_INSTALL in (ROOT / "docs" / "simulator.md").read_text()
    assert not (tmp_path / "out").exists()


def test_simulate_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "simulate",
            "--scenario",
            "ci",
            "--requests",
            "16",
            "--policies",
            "eager,kvguard",
            "--sweep",
            "",
            "--no-progress",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == EXIT_OK
    out = capsys.readouterr().out
    assert "kvguard" in out and "escapes" in out
    data = json.loads((tmp_path / "report.json").read_text())
    assert [s["policy"] for s in data["main"]] == ["eager", "kvguard"]
    assert data["guarded_escapes"] == 0


def test_bad_option_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--policies", "nonsense"])
    assert exc.value.code == 2


def test_cli_import_leaves_torch_out() -> None:
    code = "import sys, kvguard.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# ------------------------------------------------------------ errors and exit codes

CI_RUN = ["simulate", "--scenario", "ci", "--policies", "kvguard", "--sweep", "", "--no-plot"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-blocks", "0"], "--num-blocks: must be at least 1, got 0"),
        (["--num-blocks", "3"], "num_blocks=3 is too small"),
        (["--tier-blocks", "-1"], "--tier-blocks: must be at least 0, got -1"),
        (["--requests", "0"], "--requests: must be at least 1, got 0"),
        (["--requests", "-5"], "--requests: must be at least 1, got -5"),
        (["--requests", "many"], "expected an integer, got 'many'"),
        (["--num-blocks", str(10**12)], "GiB is available"),
        (["--policies", "nonsense"], "expected a comma-separated subset"),
        (["--fault-rate", "abc"], "--fault-rate: a fault rate is a number from 0 to 1"),
        (["--fault-rate", "1.5"], "got '1.5'"),
        (["--fault-rate", "nan"], "got 'nan'"),
        (["--sweep", "0.1,x"], "--sweep: a fault rate is a number from 0 to 1"),
        (["--seed", "x"], "--seed: expected an integer, got 'x'"),
    ],
)
def test_bad_arguments_are_one_line_usage_errors(
    args: list[str], message: str, tmp_path: Path
) -> None:
    run = _kvguard(*CI_RUN, "--out", str(tmp_path / "out"), *args)
    assert run.returncode == EXIT_USAGE, run.stderr
    assert message in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "out" / "report.json").exists()


def test_every_typed_option_names_itself_and_what_it_takes() -> None:
    """A value a type refuses: argparse names the option, the type says what it takes
    (a bare ValueError would name the parsing function: "invalid _rate value")."""
    typed = [a for a in _simulate_parser()._actions if a.type is not None]
    assert len(typed) >= 8
    for action in typed:
        assert callable(action.type)
        with pytest.raises(argparse.ArgumentTypeError, match=r"expected|is a number"):
            action.type("junk")


@pytest.mark.parametrize(
    ("out", "reason"),
    [
        ("file", "it is a file, not a directory; give a directory (created if missing)"),
        ("file/report", "part of its path is a file, not a directory; give a directory"),
    ],
)
def test_an_unwritable_out_is_refused_before_the_run(tmp_path: Path, out: str, reason: str) -> None:
    (tmp_path / "file").write_text("not a directory")
    run = _kvguard(*CI_RUN, "--out", str(tmp_path / out))
    assert run.returncode == EXIT_USAGE
    assert run.stderr == (
        f"kvguard simulate: cannot write the report to --out {str(tmp_path / out)!r}: {reason}\n"
    )


def test_a_crash_is_one_line_and_its_own_exit_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import kvguard.sim

    def broken(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(kvguard.sim, "simulate", broken)
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    assert main([*CI_RUN, "--no-progress", "--out", str(tmp_path)]) == EXIT_CRASH
    started, *rest = capsys.readouterr().err.splitlines()
    assert started.startswith(STARTED)
    assert rest == [
        "kvguard simulate: crashed during 'setup': ZeroDivisionError: a bug "
        f"(rerun with {TRACEBACK_ENV}=1 for the traceback)"
    ]
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(ZeroDivisionError):
        main([*CI_RUN, "--no-progress", "--out", str(tmp_path)])


def _sigint_by_default() -> None:
    """In the child before it runs Python: SIGINT's default disposition. A suite started
    in the background by a non-interactive shell (``cmd &``) inherits SIGINT ignored,
    and Python then installs no KeyboardInterrupt handler: Ctrl-C would be a no-op."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_cleanly_and_says_so(tmp_path: Path) -> None:
    long_run = [*CI_RUN, "--requests", "5000", "--out", str(tmp_path), "--no-progress"]
    with subprocess.Popen(
        [sys.executable, "-m", "kvguard", *long_run],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_sigint_by_default,  # (no threads here: preexec_fn is safe)
    ) as proc:
        assert proc.stderr is not None
        try:
            # The line that says the run is under way: Ctrl-C is handled from there on
            # (stderr carries nothing else before it; nothing goes to stdout until the end).
            started = proc.stderr.readline()
            assert started.startswith(STARTED), started
            proc.send_signal(signal.SIGINT)
            returncode = proc.wait(timeout=120)
            err = proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
    assert returncode == EXIT_INTERRUPTED, err
    assert err.startswith("kvguard simulate: interrupted") and "no report written" in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "report.json").exists()


def test_exit_codes_are_distinct_and_documented() -> None:
    codes = [EXIT_OK, EXIT_ESCAPES, EXIT_USAGE, EXIT_MISSING_DEPS, EXIT_CRASH, EXIT_INTERRUPTED]
    assert len(set(codes)) == len(codes)
    epilog = _simulate_parser().epilog
    assert epilog is not None
    for code in codes:
        assert f"{code} " in epilog


def _kvguard(*args: str, module: str = "kvguard.cli") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
