"""Shared fixtures: every pool built here checks its invariants after each mutation."""

from __future__ import annotations

import pytest

from kvguard import BlockPool, ZeroPolicy


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
