"""tools/test_report.py on a hand-made junit XML: each testcase counted once, in the
column its module's path says, with the outcome pytest wrote; a missing run is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.test_report import Counts, Kind, format_report, main, read_run

# What pytest writes (xunit2), cut down: one testcase of each kind and outcome that the
# report tells apart, a collection error, and a test that passed but failed its tear-down.
JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="4" tests="10">
<testcase classname="tests.test_pool" name="test_allocate" time="0.1"/>
<testcase classname="tests.test_pool" name="test_release" time="0.1">
  <failure message="assert 1 == 2">boom</failure></testcase>
<testcase classname="tests.test_pool.TestClass" name="test_slow" time="0.0">
  <skipped type="pytest.skip" message="slow">skipped</skipped></testcase>
<testcase classname="tests.vllm.test_adapter" name="test_teardown" time="0.1">
  <error message="failed on teardown">boom</error></testcase>
<testcase classname="tests.vllm.upstream.v0_34.test_scheduler" name="test_add[1]" time="0"/>
<testcase classname="tests.vllm.upstream.v0_34.test_scheduler" name="test_mm" time="0">
  <skipped type="pytest.skip" message="hub">skipped</skipped></testcase>
<testcase classname="" name="tests.vllm.upstream.v0_33.test_prefix_caching" time="0">
  <skipped type="pytest.skip" message="other series">skipped</skipped></testcase>
<testcase classname="tests.vllm.upstream_guarded.test_scheduler" name="test_add" time="0"/>
<testcase classname="tests.vllm.upstream_guarded_kv.test_prefix_caching" name="test_hit"
  time="0"><skipped type="pytest.xfail" message="later publication"/></testcase>
<testcase classname="" name="tests.vllm.upstream_guarded_kv.test_single_type" time="0">
  <error message="collection failure">ImportError</error></testcase>
</testsuite></testsuites>
"""


def test_each_testcase_is_counted_by_kind_and_outcome(tmp_path: Path) -> None:
    xml = tmp_path / "vllm-0.34.xml"
    xml.write_text(JUNIT, encoding="utf-8")
    assert read_run(xml) == {
        Kind.KVGUARD: Counts(passed=1, failed=2, skipped=1),
        Kind.STOCK: Counts(passed=1, skipped=2),
        Kind.GUARDED: Counts(passed=1, failed=1, xfailed=1),
    }


def test_the_table_names_each_run_and_says_when_one_has_no_report(tmp_path: Path) -> None:
    xml = tmp_path / "vllm-0.34.xml"
    xml.write_text(JUNIT, encoding="utf-8")
    broken = tmp_path / "main.xml"
    broken.write_text("<testsuites><testsuite>", encoding="utf-8")
    missing = tmp_path / "vllm-0.33.xml"

    lines = format_report([broken, missing, xml]).splitlines()

    assert lines[1] == (
        "run        kvguard's tests                vLLM's tests, stock vLLM  vLLM's tests, guarded"
    )
    assert lines[2].startswith(f"main       no report: cannot read {broken} (")
    assert lines[3] == (
        f"vllm-0.33  no report: {missing} not found (the run did not happen, or did not finish)"
    )
    assert lines[4] == (
        "vllm-0.34  1 passed, 2 failed, 1 skipped  1 passed, 2 skipped       "
        "1 passed, 1 failed, 1 xfailed"
    )
    assert lines[5].startswith("Guarded xfailed (vllm-0.34): documented differences")


def test_a_run_without_any_test_of_a_kind_says_none(tmp_path: Path) -> None:
    xml = tmp_path / "main.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="tests.test_pool" name="t"/>'
        "</testsuite></testsuites>",
        encoding="utf-8",
    )
    assert format_report([xml]).splitlines()[2].split() == ["main", "1", "passed", "none", "none"]


def test_the_command_reads_each_run_named_in_the_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "vllm-0.34.xml").write_text(JUNIT, encoding="utf-8")
    assert main([str(tmp_path), "main", "vllm-0.34"]) == 0
    rows = capsys.readouterr().out.splitlines()[2:4]
    assert [row.split()[0] for row in rows] == ["main", "vllm-0.34"]
    assert "no report" in rows[0]
    assert "no report" not in rows[1]


def test_a_folder_without_runs_is_a_usage_error() -> None:
    assert main([]) == 2
    assert main(["build/test-reports"]) == 2
