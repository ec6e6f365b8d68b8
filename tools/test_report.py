"""The test report ``.ci/run`` prints at its end: per run, three counts apart.

Each pytest run of ``.ci/run`` writes a junit XML file ``RUN.xml`` into one folder
(``PYTEST_ADDOPTS=--junitxml=...``); this reads the runs named, in that order, and prints
one row per run and one column per kind of test, by where the test lives:

* kvguard's own tests: everything but the two below;
* vLLM's tests on stock vLLM: ``tests/vllm/upstream/`` (vLLM's own tests, fetched from
  its sdist);
* vLLM's tests under the guard: ``tests/vllm/upstream_guarded*/`` (the same tests again,
  kvguard's guard on), where an expected failure is one of the documented differences
  (each strict: it must fail, as documented, or the run fails).

A run whose XML file is absent or unreadable (it did not run, or did not finish) is
reported so, not as zeros. Standard library only::

    python tools/test_report.py build/test-reports main vllm-0.33 vllm-0.34
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from enum import Enum
from pathlib import Path


class Kind(Enum):
    """Which tests a testcase belongs to (the value is its column's title)."""

    KVGUARD = "kvguard's tests"
    STOCK = "vLLM's tests, stock vLLM"
    GUARDED = "vLLM's tests, guarded"


class Outcome(Enum):
    PASSED = "passed"
    FAILED = "failed"
    XFAILED = "xfailed"
    SKIPPED = "skipped"


class ReportError(Exception):
    """A run's XML file that cannot be read: its message says which and why."""


def kind_of(testcase: ET.Element) -> Kind:
    """By the test's module: ``classname`` is its node id's path, dotted
    (``tests.vllm.upstream.v0_34.test_scheduler``); a collection error has it in
    ``name``."""
    dotted = ".".join(
        part for part in (testcase.get("classname", ""), testcase.get("name", "")) if part
    )
    parts = dotted.split(".")
    if parts[:2] == ["tests", "vllm"] and len(parts) > 2:
        if parts[2] == "upstream":
            return Kind.STOCK
        if parts[2].startswith("upstream_guarded"):
            return Kind.GUARDED
    return Kind.KVGUARD


def outcome_of(testcase: ET.Element) -> Outcome:
    """A failure or an error (of the test, its set-up or tear-down) fails it whatever
    else it reports; pytest writes an expected failure as ``<skipped type="pytest.xfail">``."""
    if testcase.find("failure") is not None or testcase.find("error") is not None:
        return Outcome.FAILED
    skipped = testcase.find("skipped")
    if skipped is None:
        return Outcome.PASSED
    return Outcome.XFAILED if skipped.get("type") == "pytest.xfail" else Outcome.SKIPPED


@dataclass
class Counts:
    """How many tests of one kind ended how, in one run."""

    passed: int = 0
    failed: int = 0
    xfailed: int = 0
    skipped: int = 0

    def add(self, outcome: Outcome) -> None:
        setattr(self, outcome.value, getattr(self, outcome.value) + 1)

    def __str__(self) -> str:
        counts = [(getattr(self, o.value), o.value) for o in Outcome]
        return ", ".join(f"{n} {what}" for n, what in counts if n) or "none"


def read_run(path: Path) -> dict[Kind, Counts]:
    """The counts of the run whose junit XML is ``path``, by kind."""
    try:
        root = ET.parse(path).getroot()
    except FileNotFoundError:
        raise ReportError(
            f"no report: {path} not found (the run did not happen, or did not finish)"
        ) from None
    except (OSError, ET.ParseError) as error:
        raise ReportError(f"no report: cannot read {path} ({error})") from error
    counts = {kind: Counts() for kind in Kind}
    for testcase in root.iter("testcase"):
        counts[kind_of(testcase)].add(outcome_of(testcase))
    return counts


def format_report(paths: list[Path]) -> str:
    """The table: one row per run (named by its file's stem), a column per kind."""
    header = ["run", *(kind.value for kind in Kind)]
    rows: list[list[str]] = []
    notes: list[str] = []
    for path in paths:
        try:
            counts = read_run(path)
        except ReportError as error:
            rows.append([path.stem, str(error)])
            continue
        rows.append([path.stem, *(str(counts[kind]) for kind in Kind)])
        if counts[Kind.GUARDED].xfailed:
            notes.append(path.stem)
    # Widths over the full rows only: a run without a report has its reason across them.
    full = [header, *(row for row in rows if len(row) == len(header))]
    widths = [max(len(row[i]) for row in full) for i in range(len(header))]
    lines = ["Test report (junit XML per run)"]
    for row in [header, *rows]:
        cells = zip(row, widths, strict=False)  # (a short row's reason: its own width)
        lines.append("  ".join(cell.ljust(width) for cell, width in cells).rstrip())
    if notes:
        lines.append(
            f"Guarded xfailed ({', '.join(notes)}): documented differences, each a strict "
            "expected failure (tests/vllm/upstream_guarded*/conftest.py says why)."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: test_report.py FOLDER RUN [RUN ...]  (reads FOLDER/RUN.xml)", file=sys.stderr)
        return 2
    folder, *runs = args
    print(format_report([Path(folder) / f"{run}.xml" for run in runs]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
