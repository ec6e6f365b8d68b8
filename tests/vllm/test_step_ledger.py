"""The guarded scheduler's record of the blocks vLLM cached (``StepLedger``) on its own:
where a note goes (the step being scheduled, settled, noted), what a step takes over
when it is sealed, and what a request's leaving drops. The publications the blocks are
due are the pool's, not the ledger's. (No vLLM needed: the ledger is plain Python.)"""

from __future__ import annotations

import pytest

from kvguard.adapters.vllm.scheduler.step_ledger import StepLedger

pytestmark = pytest.mark.vllm


def test_notes_while_a_step_is_scheduled_are_that_steps_fills() -> None:
    ledger = StepLedger(settles=lambda request_id, num_tokens: True)  # never asked here
    ledger.carried.add("a", [9])
    ledger.carried.add("c", [7])
    ledger.open()
    ledger.note("a", [1, 2], 32)
    ledger.note("b", [3], 16)
    token = object()
    record = ledger.seal(token, {"a": 32, "b": 16})
    # The step's own fills first, then what the requests it schedules carried.
    assert record.fills == {"a": [1, 2, 9], "b": [3]}
    assert ledger.carried.fills == {"c": [7]}
    assert not ledger.noted.fills and not ledger.settled
    assert ledger.close(token) is record and len(ledger) == 0


def test_notes_outside_a_step_are_settled_or_noted_by_the_rule() -> None:
    ledger = StepLedger(settles=lambda request_id, num_tokens: request_id != "unchecked")
    ledger.note("a", [4, 5], 32)
    ledger.note("unchecked", [6], 16)
    ledger.note("b", [1], 16)
    assert ledger.settled == [4, 5, 1]
    assert ledger.noted.fills == {"unchecked": [6]}
    assert ledger.take_settled() == [4, 5, 1] and not ledger.settled
    noted = ledger.take_noted()
    assert noted.fills == {"unchecked": [6]}
    assert ledger.is_empty()


def test_a_held_entry_is_noted_once() -> None:
    """An entry vLLM registers for one block, withdrawn and registered again within the
    step, leaves the block noted once (outside a step too)."""
    ledger = StepLedger()
    ledger.open()
    ledger.hold("a", 4, 16)
    ledger.hold("a", 4, 16)
    assert ledger.seal(object(), {"a": 16}).fills == {"a": [4]}
    ledger.hold("a", 5, 32)
    ledger.hold("a", 5, 32)
    assert ledger.noted.fills == {"a": [5]}


def test_without_a_rule_every_note_outside_a_step_is_noted() -> None:
    ledger = StepLedger()
    ledger.note("a", [4], 16)
    assert not ledger.settled and ledger.noted.fills == {"a": [4]}
    assert not ledger.is_empty()
    ledger.open()  # what was noted and never taken is dropped
    assert not ledger.noted.fills


def test_a_request_that_leaves_is_dropped_from_every_step_and_its_carry() -> None:
    ledger = StepLedger()
    for token, blocks in ((1, [1]), (2, [2])):
        ledger.open()
        ledger.note("a", blocks, 16 * token)
        ledger.seal(token, {"a": 16, "b": 16})
    ledger.carried.add("a", [8])
    assert ledger.in_flight("a") and list(ledger.fills_in_flight("a")) == [1, 2]
    assert ledger.tokens_in_flight("a") == 32
    ledger.forget("a")
    assert not list(ledger.fills_in_flight("a")) and ledger.tokens_in_flight("a") == 0
    assert ledger.in_flight("a")  # its steps are still in flight, for b
    assert not ledger.carried.fills
    assert [ledger.close(t).dropped for t in (1, 2)] == [{"a"}, {"a"}]  # type: ignore[union-attr]
    assert ledger.is_empty()


def test_a_roll_back_names_the_blocks_its_steps_filled() -> None:
    """``recover``: the request stays, its steps in flight forget it, and the blocks
    they filled are returned for the pool to withdraw their publications; what it
    carried stays its own."""
    ledger = StepLedger()
    for token, blocks in ((1, [1, 2]), (2, [3])):
        ledger.open()
        ledger.note("a", blocks, 16 * token)
        ledger.seal(token, {"a": 16})
    ledger.carried.add("a", [8])
    assert ledger.roll_back("a") == [1, 2, 3]
    assert not list(ledger.fills_in_flight("a")) and ledger.tokens_in_flight("a") == 0
    assert ledger.carried.fills == {"a": [8]}


def test_a_window_takes_freed_blocks_out_of_the_steps_in_flight() -> None:
    ledger = StepLedger()
    ledger.open()
    ledger.note("a", [1, 2, 3], 48)
    ledger.seal(1, {"a": 48})
    assert ledger.filled_in_flight("a", [3, 4, 1]) == {1, 3}
    assert ledger.filled_in_flight("a", [4]) == set() == ledger.filled_in_flight("b", [1])
    assert ledger.take_fills("a", {1, 3}) == [1, 3]
    assert list(ledger.fills_in_flight("a")) == [2]
    ledger.carried.add("a", [5, 6])
    ledger.carried.drop("a", {5})
    assert ledger.carried.fills == {"a": [6]}


def test_a_request_preempted_while_its_step_is_scheduled_keeps_nothing_of_it() -> None:
    """vLLM's priority policy may preempt a request it already scheduled in the step
    it is scheduling: its blocks are released (and may be reused at once), so the
    fills it noted in that step must neither be validated by the step nor carried to
    the request's next one (which would publish another owner's block under its hash)."""
    ledger = StepLedger(settles=None)
    ledger.open()
    ledger.note("low", [1, 2], 32)
    ledger.note("high", [3], 16)
    ledger.forget("low")  # preempted; vLLM takes it out of the step's scheduled tokens
    token = object()
    record = ledger.seal(token, {"high": 16})
    assert record.fills == {"high": [3]}
    assert "low" in record.dropped


def test_the_pools_outbox_is_noted_in_order() -> None:
    """``note_cached``: what the pool's outbox held, as :meth:`note` / :meth:`hold` would
    note it one entry at a time -- into the step being scheduled, or by the rule."""
    ledger = StepLedger(settles=lambda request_id, num_tokens: num_tokens <= 16)
    ledger.open()
    ledger.note_cached([("a", [1, 2], 32, False), ("b", [3], 16, False), ("a", [4], 48, False)])
    ledger.note_cached([("a", [4], 48, True), ("b", [5], 32, True)])
    assert ledger.seal(object(), {"a": 48, "b": 32}).fills == {"a": [1, 2, 4], "b": [3, 5]}
    ledger.note_cached([("a", [6], 16, False), ("b", [7], 32, False), ("b", [7], 32, True)])
    assert ledger.settled == [6] and ledger.noted.fills == {"b": [7]}
