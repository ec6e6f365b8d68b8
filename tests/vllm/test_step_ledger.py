"""The one record of held-back publications (``StepLedger``) on its own: where a note goes
(the step being scheduled, settled, noted), what a step takes over when it is sealed,
and what a request's leaving drops. (No vLLM needed: the ledger is plain Python.)"""

from __future__ import annotations

import pytest

from kvguard.adapters.vllm.scheduler.step_ledger import StepLedger
from kvguard.block import PendingPublication
from kvguard.hashing import BlockHash

pytestmark = pytest.mark.vllm


def _publication(block_id: int, owner: str) -> PendingPublication:
    return (BlockHash(bytes([block_id]) * 8), None, owner)


def _note(ledger: StepLedger, request_id: str, block_ids: list[int], num_tokens: int) -> None:
    """What the guarded pool's cache_full_blocks does: the publications first (where
    ``noting`` says), then the note."""
    for block_id in block_ids:
        ledger.noting[block_id] = _publication(block_id, request_id)
    ledger.note(request_id, block_ids, num_tokens)


def test_notes_while_a_step_is_scheduled_are_that_steps_fills() -> None:
    ledger = StepLedger(settles=lambda request_id, num_tokens: True)  # never asked here
    ledger.carried.add("a", [9], {9: _publication(9, "a")})
    ledger.carried.add("c", [7], {7: _publication(7, "c")})
    ledger.open()
    _note(ledger, "a", [1, 2], 32)
    _note(ledger, "b", [3], 16)
    token = object()
    record = ledger.seal(token, {"a": 32, "b": 16})
    # The step's own fills first, then what the requests it schedules carried.
    assert record.fills == {"a": [1, 2, 9], "b": [3]}
    assert sorted(record.publications) == [1, 2, 3, 9]
    assert ledger.carried.fills == {"c": [7]} and list(ledger.carried.publications) == [7]
    assert not ledger.noted.fills and not ledger.settled
    assert ledger.close(token) is record and len(ledger) == 0


def test_notes_outside_a_step_are_settled_or_noted_by_the_rule() -> None:
    ledger = StepLedger(settles=lambda request_id, num_tokens: request_id != "unchecked")
    _note(ledger, "a", [4, 5], 32)
    _note(ledger, "unchecked", [6], 16)
    _note(ledger, "b", [1], 16)
    assert ledger.settled == [4, 5, 1]
    assert ledger.noted.fills == {"unchecked": [6]} and list(ledger.noted.publications) == [6]
    ids, publications = ledger.take_settled()
    assert ids == [4, 5, 1] and sorted(publications) == [1, 4, 5]
    noted = ledger.take_noted()
    assert noted.fills == {"unchecked": [6]}
    assert ledger.noting is ledger.noted.publications and not ledger.noting
    assert ledger.is_empty()


def test_without_a_rule_every_note_outside_a_step_is_noted() -> None:
    ledger = StepLedger()
    _note(ledger, "a", [4], 16)
    assert not ledger.settled and ledger.noted.fills == {"a": [4]}
    assert list(ledger.held_blocks()) == [4]
    ledger.open()  # what was noted and never taken is dropped
    assert not ledger.noted.fills and ledger.noting is ledger.scheduling.publications  # type: ignore[union-attr]


def test_a_request_that_leaves_is_dropped_from_every_step_and_its_carry() -> None:
    ledger = StepLedger()
    for token, blocks in ((1, [1]), (2, [2])):
        ledger.open()
        _note(ledger, "a", blocks, 16 * token)
        ledger.seal(token, {"a": 16, "b": 16})
    ledger.carried.add("a", [8], {8: _publication(8, "a")})
    assert ledger.in_flight("a") and list(ledger.fills_in_flight("a")) == [1, 2]
    assert ledger.tokens_in_flight("a") == 32
    ledger.forget("a")
    assert not list(ledger.fills_in_flight("a")) and ledger.tokens_in_flight("a") == 0
    assert ledger.in_flight("a")  # its steps are still in flight, for b
    assert not ledger.carried.fills and not ledger.carried.publications
    assert [ledger.close(t).dropped for t in (1, 2)] == [{"a"}, {"a"}]  # type: ignore[union-attr]
    assert ledger.is_empty()


def test_a_window_takes_freed_blocks_out_of_the_steps_in_flight() -> None:
    ledger = StepLedger()
    ledger.open()
    _note(ledger, "a", [1, 2, 3], 48)
    ledger.seal(1, {"a": 48})
    taken, publications = ledger.take_fills("a", {1, 3})
    assert taken == [1, 3] and sorted(publications) == [1, 3]
    assert list(ledger.fills_in_flight("a")) == [2]
    ledger.carried.add("a", [5, 6], {5: _publication(5, "a"), 6: _publication(6, "a")})
    ledger.carried.drop("a", {5})
    assert ledger.carried.fills == {"a": [6]} and list(ledger.carried.publications) == [6]


def test_a_request_preempted_while_its_step_is_scheduled_keeps_nothing_of_it() -> None:
    """vLLM's priority policy may preempt a request it already scheduled in the step
    it is scheduling: its blocks are released (and may be reused at once), so the
    fills it noted in that step must neither be validated by the step nor carried to
    the request's next one (which would publish another owner's block under its hash)."""
    ledger = StepLedger(settles=None)
    ledger.open()
    _note(ledger, "low", [1, 2], 32)
    _note(ledger, "high", [3], 16)
    ledger.forget("low")  # preempted; vLLM takes it out of the step's scheduled tokens
    token = object()
    record = ledger.seal(token, {"high": 16})
    assert record.fills == {"high": [3]} and sorted(record.publications) == [3]
    assert "low" in record.dropped
    assert sorted(ledger.held_blocks()) == []
