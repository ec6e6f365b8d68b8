"""``recompute_after_lost_steps``: what a request whose steps in flight are lost
recomputes, rolled back (kvguard) or with its touched blocks dropped (vLLM PR #50265,
abort and resubmit)."""

from __future__ import annotations

from typing import Any

import pytest

from kvguard.errors import PoolMisuseError
from kvguard.recovery import RecomputeCost, recompute_after_lost_steps


@pytest.mark.parametrize(
    ("computed", "in_flight", "published", "expected"),
    [
        # The real-engine trace (32-token blocks): a prefilled 24 tokens, lost 24..86,
        # nothing published; b decoded its token 40 with its first block published.
        (87, 63, 0, RecomputeCost(rollback=63, drop_blocks=87)),
        (41, 1, 1, RecomputeCost(rollback=1, drop_blocks=9)),
        # Published blocks past the boundary's block are touched: dropped.
        (96, 40, 3, RecomputeCost(rollback=40, drop_blocks=96 - 32)),
        # A boundary on a block edge keeps every published block below it.
        (96, 32, 2, RecomputeCost(rollback=32, drop_blocks=32)),
        # Nothing lost: nothing recomputed, whatever is published.
        (64, 0, 2, RecomputeCost(rollback=0, drop_blocks=0)),
        # Validated but not published (caching off): a rollback keeps it, a drop does not.
        (64, 0, 0, RecomputeCost(rollback=0, drop_blocks=64)),
    ],
)
def test_figures(computed: int, in_flight: int, published: int, expected: RecomputeCost) -> None:
    assert recompute_after_lost_steps(computed, in_flight, 32, published) == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((10, 11, 4, 0), r"in_flight \(11\) exceeds computed \(10\)"),
        ((10, 1, 0, 0), "block_size must be at least 1"),
        ((-1, 0, 4, 0), "computed must be >= 0"),
        ((10, 1, 4, True), "published_blocks must be an int"),
        ((10, 1.0, 4, 0), "in_flight must be an int"),
    ],
)
def test_bad_input_is_refused(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(PoolMisuseError, match=message):
        recompute_after_lost_steps(*args)
