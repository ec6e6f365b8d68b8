"""The exit rule as the connectors' tests check it: one fixture, not a copy per test file.

A block may leave the instance (be copied to a tier, shared, sent) only when it is
VALIDATED or later and carries a key; the gate asks the same of the core
(``TierGate.storable_as``). The states come from the core's table, never restated here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvguard.states import STORABLE_STATES, BlockState


def may_leave(state: BlockState) -> bool:
    """Whether a block in ``state`` may leave the instance (given it carries a key)."""
    return state in STORABLE_STATES


def assert_may_leave(core: Any, block_ids: Iterable[int]) -> None:
    """Every block of ``block_ids`` in kvguard's pool ``core`` may leave now: VALIDATED
    or later, and hashed. Fails naming the blocks that may not."""
    refused = {
        b: (info.state.name, info.block_hash)
        for b in block_ids
        if not may_leave((info := core.block_info(b)).state) or info.block_hash is None
    }
    assert not refused, f"blocks copied out that may not leave (state, hash): {refused}"
