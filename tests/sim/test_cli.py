"""The ``kvguard`` command line: help, a small end-to-end run, exit status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvguard.cli import EXIT_OK, build_parser, main


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
