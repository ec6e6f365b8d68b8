"""The ``kvguard`` command line: help, a small end-to-end run, exit status."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvguard.cli import (
    EXIT_CRASH,
    EXIT_ESCAPES,
    EXIT_INTERRUPTED,
    EXIT_MISSING_DEPS,
    EXIT_OK,
    EXIT_USAGE,
    TRACEBACK_ENV,
    build_parser,
    main,
)


def test_every_simulate_option_is_documented() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    simulate = sub.choices["simulate"]  # type: ignore[index]
    for action in simulate._actions:
        assert action.help, f"option {action.option_strings} has no help"


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


def test_an_unwritable_out_is_refused_before_the_run(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    run = _kvguard(*CI_RUN, "--out", str(blocker / "report"))
    assert run.returncode == EXIT_USAGE
    assert run.stderr.strip().startswith("kvguard simulate: cannot write the report to --out")
    assert len(run.stderr.strip().splitlines()) == 1 and "running" not in run.stderr


def test_a_crash_is_one_line_and_its_own_exit_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import kvguard.sim

    def broken(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(kvguard.sim, "simulate", broken)
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    assert main([*CI_RUN, "--no-progress", "--out", str(tmp_path)]) == EXIT_CRASH
    err = capsys.readouterr().err.strip()
    assert err == (
        "kvguard simulate: crashed during 'setup': ZeroDivisionError: a bug "
        f"(rerun with {TRACEBACK_ENV}=1 for the traceback)"
    )
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(ZeroDivisionError):
        main([*CI_RUN, "--no-progress", "--out", str(tmp_path)])


def test_ctrl_c_stops_cleanly_and_says_so(tmp_path: Path) -> None:
    long_run = [*CI_RUN, "--requests", "5000", "--out", str(tmp_path), "--no-progress"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvguard.cli", *long_run],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(8)  # torch imported, the ground-truth run under way
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert err.startswith("kvguard simulate: interrupted") and "no report written" in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "report.json").exists()


def test_exit_codes_are_distinct_and_documented() -> None:
    codes = [EXIT_OK, EXIT_ESCAPES, EXIT_USAGE, EXIT_MISSING_DEPS, EXIT_CRASH, EXIT_INTERRUPTED]
    assert len(set(codes)) == len(codes)
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    epilog = sub.choices["simulate"].epilog  # type: ignore[index]
    for code in codes:
        assert f"{code} " in epilog


def _kvguard(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvguard.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
