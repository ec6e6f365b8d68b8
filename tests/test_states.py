"""The transition table: exhaustive state x event grid, and the generated docs diagram."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvguard import BlockPool, BlockState, IllegalTransitionError
from kvguard.states import TRANSITIONS, BlockEvent, mermaid_diagram, next_state

GRID = [(state, event) for state in BlockState for event in BlockEvent]


def test_block_state_has_exactly_the_designed_members() -> None:
    assert [s.name for s in BlockState] == [
        "FREE",
        "ALLOCATED",
        "WRITTEN",
        "VALIDATED",
        "PUBLISHED",
        "OFFLOADED",
        "QUARANTINED",
    ]
    assert set(TRANSITIONS) == set(BlockState)


@pytest.mark.parametrize(("state", "event"), GRID, ids=lambda v: v.name)
def test_grid(state: BlockState, event: BlockEvent) -> None:
    """Every (state, event) either follows the table or raises, changing nothing."""
    pool = BlockPool(2, 4)
    block = pool._kernel.blocks[0]
    # Put block 0 into ``state`` behind the pool's back, then drive the pool's single
    # writer of states.
    block.state = state
    before = pool.snapshot()
    expected = TRANSITIONS[state].get(event)
    if expected is None:
        with pytest.raises(IllegalTransitionError) as info:
            pool._kernel._move(block, event)
        assert (info.value.block_id, info.value.state, info.value.event) == (0, state, event)
        assert state.name in str(info.value) and event.name in str(info.value)
        assert block.state is state
        assert pool.snapshot() == before
        with pytest.raises(IllegalTransitionError):
            next_state(0, state, event)
    else:
        pool._kernel._move(block, event)
        assert block.state is expected is next_state(0, state, event)
        assert pool.stats().blocks_by_state[expected] == 1 + (expected is BlockState.FREE)


def test_safety_rows_of_the_table() -> None:
    """The rows that carry the promises of docs/design.md, spelled out."""
    S, E = BlockState, BlockEvent
    # Nothing unvalidated becomes matchable: PUBLISH only from VALIDATED.
    assert {s for s in S if E.PUBLISH in TRANSITIONS[s]} == {S.VALIDATED}
    # A prefix hit only takes published/offloaded blocks.
    assert {s for s in S if E.ACQUIRE in TRANSITIONS[s]} == {S.PUBLISHED, S.OFFLOADED}
    # Quarantine is left only by reuse (zeroed) or by a tail rollback (wiped).
    assert set(TRANSITIONS[S.QUARANTINED].values()) == {S.ALLOCATED, S.QUARANTINED}
    # An unvalidated block released can only become quarantined.
    assert TRANSITIONS[S.WRITTEN][E.RELEASE] is S.QUARANTINED


def test_docs_diagram_matches_table() -> None:
    doc = (Path(__file__).parent.parent / "docs" / "states.md").read_text()
    blocks = re.findall(r"```mermaid\n(.*?)\n```", doc, re.S)
    assert blocks, "docs/states.md has no mermaid block"
    assert blocks[0] == mermaid_diagram(), (
        "docs/states.md is stale: regenerate it with `python -m kvguard.statedoc docs/states.md`"
    )
