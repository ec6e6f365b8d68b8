"""Shared fixtures: every pool built here checks its invariants after each mutation.
And the end-to-end tests' time limit."""

from __future__ import annotations

import pytest

from kvguard import BlockPool, ZeroPolicy

E2E_TIMEOUT_S = 900
"""Per test marked ``e2e`` (a real engine starts, loads a model, serves): longer than
pyproject's limit for every other test. A test's own ``timeout`` mark wins."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("e2e") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))


def make_pool(
    num_blocks: int = 16,
    block_size: int = 4,
    *,
    enable_caching: bool = True,
    zero_policy: ZeroPolicy = ZeroPolicy.SUSPECT,
) -> BlockPool:
    return BlockPool(
        num_blocks,
        block_size,
        enable_caching=enable_caching,
        zero_policy=zero_policy,
        check_invariants=True,
    )


@pytest.fixture
def pool() -> BlockPool:
    return make_pool()
