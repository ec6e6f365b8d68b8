"""The guarded re-runs of vLLM's tests (tests/vllm/upstream_guarded*/) expect some of
them to fail, by exception *and* message (tests/vllm/upstream/expected_failure.py): a
kvguard bug behind one of those tests is a real failure, not an expected one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from kvguard.adapters.vllm.config import GuardConfig  # noqa: E402
from kvguard.adapters.vllm.pool.block_pool import GuardedBlockPool, PartialEntryError  # noqa: E402
from kvguard.errors import (  # noqa: E402
    ConsistencyError,
    KvGuardError,
    UnknownRequestError,
)
from tests.vllm.upstream.expected_failure import (  # noqa: E402
    ExpectedFailure,
    UnexpectedFailure,
    expect,
)

ROOT = Path(__file__).parent.parent.parent

VLLM_ASSERT = ExpectedFailure(AssertionError, r"^assert 0 == 8\b", "vLLM's assertion")


def _raising(exc: BaseException) -> Callable[[], None]:
    def call() -> None:
        raise exc

    return call


def _corrupt_pool() -> GuardedBlockPool:
    """A guarded pool whose vLLM view disagrees with kvguard: a second null block."""
    pool = GuardedBlockPool(8, True, 4, guard=GuardConfig(enabled=True))
    pool.blocks[3].is_null = True
    return pool


def test_the_expected_exception_with_its_message_passes_through() -> None:
    with pytest.raises(AssertionError, match="assert 0 == 8"):
        expect(VLLM_ASSERT, _raising(AssertionError("assert 0 == 8\n +  where 0 = len([])")))()


@pytest.mark.parametrize(
    ("exc", "why"),
    [
        (AssertionError("assert 0 == 80"), "another message"),
        (KeyError("assert 0 == 8"), "another exception"),
        # kvguard's misuse error is an AssertionError too (as vLLM's pool fails that call)
        (PartialEntryError("assert 0 == 8"), "a kvguard error"),
    ],
)
def test_anything_else_fails_naming_both(exc: BaseException, why: str) -> None:
    with pytest.raises(UnexpectedFailure) as info:
        expect(VLLM_ASSERT, _raising(exc))()
    message = str(info.value)
    assert "expected AssertionError matching '^assert 0 == 8\\\\b'" in message
    assert f"{type(exc).__qualname__}: {exc}" in message
    assert f"({why}" in message
    assert info.value.__cause__ is exc


def test_an_unknown_request_is_not_vllms_key_error() -> None:
    """UnknownRequestError is a KeyError (kvguard's lookups by request id fail as a
    mapping's do); an expected KeyError of vLLM's never accepts it, whatever the text."""
    any_key = ExpectedFailure(KeyError, "", "vLLM's lookup")
    with pytest.raises(UnexpectedFailure, match="a kvguard error"):
        expect(any_key, _raising(UnknownRequestError("r")))()


def test_a_consistency_failure_cannot_pass_as_expected() -> None:
    """kvguard's consistency check raises its own corruption error, never an
    AssertionError; no expected failure accepts it, not even one of kvguard's types
    matching any message."""
    with pytest.raises(ConsistencyError, match="block 3 is a second null block") as info:
        _corrupt_pool().check_consistency()
    assert not isinstance(info.value, AssertionError | KeyError)
    for expected, why in (
        (ExpectedFailure(AssertionError, "", "any assertion"), "another exception"),
        (ExpectedFailure(KvGuardError, "", "any kvguard error"), "its own bookkeeping broken"),
    ):
        with pytest.raises(
            UnexpectedFailure, match=r"got kvguard\.errors\.ConsistencyError"
        ) as got:
            expect(expected, _corrupt_pool().check_consistency)()
        assert why in str(got.value)


def test_an_expected_failure_cannot_accept_everything() -> None:
    with pytest.raises(ValueError, match="would let any failure pass"):
        ExpectedFailure(Exception, "", "anything")


_MODULE = """
from kvguard.adapters.vllm.pool.block_pool import GuardedBlockPool, PartialEntryError
from kvguard.adapters.vllm.config import GuardConfig


def test_vllm_assertion():
    assert 0 == 8


def test_other_assertion():
    assert 0 == 80


def test_kvguard_consistency():
    pool = GuardedBlockPool(8, True, 4, guard=GuardConfig(enabled=True))
    pool.blocks[3].is_null = True
    pool.check_consistency()


def test_kvguard_misuse():
    raise PartialEntryError("assert 0 == 8")


def test_passes():
    pass
"""

_CONFTEST = """
from tests.vllm.upstream.conftest import mark_guarded_item
from tests.vllm.upstream.expected_failure import ExpectedFailure


def pytest_collection_modifyitems(items):
    for item in items:
        match = "" if item.name == "test_kvguard_consistency" else r"^assert 0 == 8\\b"
        expected = ExpectedFailure(AssertionError, match, "by design")
        mark_guarded_item(item, item.nodeid, {item.nodeid: expected})
"""


def test_under_pytest_only_vllms_failure_is_an_expected_one(tmp_path: Path) -> None:
    """The guarded re-runs' marking, in a pytest run of its own: the test failing with
    the expected assertion is xfailed; another message, kvguard's consistency check
    (with any message allowed) and kvguard's misuse error (an AssertionError with the
    expected text) fail, and so does a test that passes (strict)."""
    (tmp_path / "test_x.py").write_text(textwrap.dedent(_MODULE))
    (tmp_path / "conftest.py").write_text(textwrap.dedent(_CONFTEST))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    report = tmp_path / "report.xml"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTEST_ADDOPTS": ""}
    # (run() kills the child if it outlives the timeout)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={report}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert report.exists(), done.stdout + done.stderr
    outcomes: dict[str | None, str | None] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        children = {child.tag: child for child in case}
        if "failure" in children:
            outcomes[case.get("name")] = "failed"
        elif "skipped" in children:
            outcomes[case.get("name")] = children["skipped"].get("type")
        else:
            outcomes[case.get("name")] = "passed"
    assert outcomes == {
        "test_vllm_assertion": "pytest.xfail",
        "test_other_assertion": "failed",
        "test_kvguard_consistency": "failed",
        "test_kvguard_misuse": "failed",
        "test_passes": "failed",
    }, done.stdout
    assert "UnexpectedFailure: expected AssertionError matching" in done.stdout
