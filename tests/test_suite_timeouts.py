"""Every test has a time limit (pytest-timeout, configured in pyproject.toml), the
end-to-end ones a longer one (tests/conftest.py): a hung test fails, naming itself,
instead of hanging the run."""

from __future__ import annotations

import pytest

from .conftest import E2E_TIMEOUT_S

pytest_plugins = ["pytester"]

TESTS = """
import pytest

def _limit(request):
    mark = request.node.get_closest_marker("timeout")
    return None if mark is None else mark.args[0]

@pytest.mark.e2e
def test_e2e(request):
    assert _limit(request) == {e2e}

@pytest.mark.e2e
@pytest.mark.timeout(7)
def test_e2e_with_its_own(request):
    assert _limit(request) == 7

def test_plain(request):
    assert _limit(request) is None  # pyproject's limit applies
"""


def test_every_test_has_a_limit_and_e2e_tests_a_longer_one(
    pytester: pytest.Pytester, pytestconfig: pytest.Config
) -> None:
    assert float(pytestconfig.getini("timeout")) < E2E_TIMEOUT_S
    # (method "signal": a timed-out test fails and its cleanup kills its subprocesses)
    assert pytestconfig.getini("timeout_method") == "signal"
    pytester.makeconftest("from tests.conftest import pytest_collection_modifyitems")
    pytester.makeini("[pytest]\nmarkers =\n    e2e: end-to-end\n")
    pytester.makepyfile(TESTS.format(e2e=E2E_TIMEOUT_S))
    pytester.runpytest("--strict-markers", "-p", "no:cacheprovider").assert_outcomes(passed=3)
