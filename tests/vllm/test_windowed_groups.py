"""Guarded mode on KV cache groups whose blocks vLLM frees while a request runs:
sliding-window, chunked-local and R-SWA groups, alone and beside full attention.

vLLM frees the blocks that left a running request's window or local chunk, or R-SWA's
gap between prompt and window (``remove_skipped_blocks``, below its processed tokens).
Every step that wrote them reported back, so after clean steps they are freed validated
-- cached ones stay hits, none is quarantined or zeroed -- while a request whose last
step is not known clean has them quarantined.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from kvguard import BlockState  # noqa: E402
from kvguard.errors import EngineContractError  # noqa: E402

from .harness import (  # noqa: E402
    BLOCK,
    decision_trace,
    finish_reasons,
    hit_tokens,
    make_request,
    make_scheduler,
    model_output,
    shared_prefix_arrivals,
    step,
)

WINDOWED = [("sliding",), ("full", "sliding"), ("chunked",), ("full", "chunked")]
"""Groups whose window (or local chunk) leaves the prompt's first blocks behind."""
FREEING = [*WINDOWED, ("rswa",), ("full", "rswa")]
"""Every group shape whose blocks vLLM frees while the request runs (R-SWA frees the
gap between the prompt and its decode window)."""
PROMPT = list(range(3000, 3000 + 5 * BLOCK + 3))
NULL = 0  # vLLM's null block: what a block table holds where the window freed a block


def _tables(s: Any, req_id: str) -> tuple[list[int], ...]:
    return tuple(s.kv_cache_manager.get_block_ids(req_id))


def _windowed_table(s: Any, req_id: str) -> list[int]:
    """The windowed group's block table (the last group in these tests)."""
    return _tables(s, req_id)[-1]


def _count(s: Any, state: BlockState) -> int:
    return int(s.kvguard_pool.core.stats().blocks_by_state[state])


def _window_freed(s: Any, req_id: str, before: list[int]) -> list[int]:
    table = _windowed_table(s, req_id)
    return [old for old, now in zip(before, table, strict=False) if now == NULL != old]


@pytest.mark.parametrize("groups", WINDOWED)
def test_blocks_the_window_frees_after_clean_steps_stay_hits_unquarantined(
    groups: tuple[str, ...],
) -> None:
    s = make_scheduler(groups=groups)
    s.add_request(make_request("a", PROMPT, max_tokens=30))
    # The first prefill chunk: 4 full blocks, validated and published (a chunked-local
    # group alone skips the prompt's first local chunk instead: 2 full blocks).
    step(s)
    before = list(_windowed_table(s, "a"))
    assert before.count(NULL) == (3 if groups == ("chunked",) else 0)
    for _ in range(14):  # past token 96: the second local chunk's end
        step(s)
        s.kvguard_pool.check_consistency()
    freed = _window_freed(s, "a", before)
    assert len(freed) >= 2, "the window did not move past the prompt's first blocks"
    core = s.kvguard_pool.core
    for block_id in freed:
        info = core.block_info(block_id)
        assert info.state is BlockState.PUBLISHED and info.ref_cnt == 0
    assert _count(s, BlockState.QUARANTINED) == 0
    assert s.kvguard_stats()["blocks_quarantined"] == 0
    # The prompt, published at its step's validation, serves a newcomer.
    s.add_request(make_request("b", PROMPT, max_tokens=2))
    so = s.schedule()
    assert hit_tokens(so) == {"b": 5 * BLOCK}
    assert not so.new_block_ids_to_zero
    s.update_from_output(so, model_output(s, so))
    s.kvguard_pool.check_consistency()


@pytest.mark.parametrize("groups", WINDOWED)
def test_nan_after_the_window_slid_aborts_and_keeps_the_validated_prefix(
    groups: tuple[str, ...],
) -> None:
    s = make_scheduler(groups=groups)
    s.add_request(make_request("a", PROMPT, max_tokens=30))
    s.add_request(make_request("bystander", list(range(8000, 8040)), max_tokens=30))
    for _ in range(5):
        step(s)
    assert NULL in _windowed_table(s, "a")
    _, out = step(s, {"a": 3})
    assert finish_reasons(out) == {"a": "error"}
    assert "bystander" in s.requests
    # Only the partial tail (one per group) was unvalidated.
    assert _count(s, BlockState.QUARANTINED) == len(groups)
    s.kvguard_pool.check_consistency()
    s.add_request(make_request("a-retry", PROMPT, max_tokens=2))
    so = s.schedule()
    assert hit_tokens(so) == {"a-retry": 5 * BLOCK}
    s.update_from_output(so, model_output(s, so))
    s.kvguard_pool.check_consistency()


def test_async_race_on_a_hybrid_model() -> None:
    """b, admitted the step after a's prefill was scheduled, must not hit a's blocks
    before a's output validated; a's prefill fails, and c hits b's copy instead."""
    s = make_scheduler(
        groups=("full", "sliding"), async_scheduling=True, max_num_batched_tokens=8 * BLOCK
    )
    s.add_request(make_request("a", PROMPT))
    so1 = s.schedule()
    s.add_request(make_request("b", PROMPT))
    so2 = s.schedule()
    assert hit_tokens(so2) == {"b": 0}
    out = s.update_from_output(so1, model_output(s, so1, {"a": 1}))
    assert finish_reasons(out) == {"a": "error"}
    s.update_from_output(so2, model_output(s, so2))
    s.add_request(make_request("c", PROMPT))
    so3 = s.schedule()
    assert hit_tokens(so3) == {"c": 5 * BLOCK}
    # In every group c's hit blocks are b's (a sliding group hits the window's tail).
    for c_table, b_table in zip(_tables(s, "c"), _tables(s, "b"), strict=True):
        hit = [b for b in c_table[:5] if b != NULL]
        assert hit and hit == [b for b in b_table[:5] if b != NULL][-len(hit) :]
    s.kvguard_pool.check_consistency()


def test_window_frees_after_an_unchecked_step_are_quarantined() -> None:
    """A step whose NaN count is missing vouches for nothing: the blocks it filled that
    the window frees before a counted step are quarantined and leave the request's
    carry; the ones still held are validated by its next counted step."""
    s = make_scheduler(groups=("sliding",), max_num_batched_tokens=8 * BLOCK)
    long_prompt = list(range(4000, 4000 + 7 * BLOCK + 3))
    s.add_request(make_request("a", long_prompt, max_tokens=10))
    so = s.schedule()
    output = model_output(s, so)
    del output.num_nans_in_logits["a"]
    s.update_from_output(so, output)  # a's prefill: not counted
    assert s.kvguard_stats()["steps_unchecked"] == 1
    prompt_table = list(_windowed_table(s, "a"))
    step(s)  # a's first decode: the window frees blocks the unchecked step filled
    freed = _window_freed(s, "a", prompt_table)
    held = [b for b in _windowed_table(s, "a")[:7] if b != NULL]
    assert freed and held
    core = s.kvguard_pool.core
    assert all(core.block_state(b) is BlockState.QUARANTINED for b in freed)
    # That decode step was counted clean: it vouched for the blocks still held.
    assert all(core.block_state(b) is BlockState.PUBLISHED for b in held)
    s.kvguard_pool.check_consistency()
    s.add_request(make_request("b", long_prompt, max_tokens=2))
    so = s.schedule()
    assert hit_tokens(so) == {"b": 7 * BLOCK}  # a window's worth of validated blocks
    assert set(so.new_block_ids_to_zero or []) <= set(freed)  # only quarantined ones
    s.update_from_output(so, model_output(s, so))
    s.kvguard_pool.check_consistency()


@pytest.mark.parametrize("groups", WINDOWED)
def test_without_prefix_caching_window_frees_after_clean_steps_are_plain_frees(
    groups: tuple[str, ...],
) -> None:
    """No block is ever published: every block the window frees is still WRITTEN, and
    is validated as it goes -- freed plainly (and reused at once), never quarantined or
    zeroed."""
    s = make_scheduler(groups=groups, prefix_caching=False)
    s.add_request(make_request("a", PROMPT, max_tokens=30))
    step(s)
    before = list(_windowed_table(s, "a"))
    core = s.kvguard_pool.core
    assert all(core.block_state(b) is BlockState.WRITTEN for b in before)
    for _ in range(4):
        so, _ = step(s)
        assert not so.new_block_ids_to_zero
    assert len(_window_freed(s, "a", before)) >= 2
    assert s.kvguard_stats()["blocks_quarantined"] == 0
    s.kvguard_pool.check_consistency()


def test_without_prefix_caching_window_frees_after_an_unchecked_step_are_quarantined() -> None:
    s = make_scheduler(groups=("sliding",), prefix_caching=False)
    s.add_request(make_request("a", PROMPT, max_tokens=30))
    step(s)
    for _ in range(2):
        step(s)
    before = list(_windowed_table(s, "a"))
    freed: list[int] = []
    while not freed:  # decode steps whose NaN counts are missing, until the window
        so = s.schedule()  # frees a block: then a's last step is not known clean
        freed = _window_freed(s, "a", before)
        output = model_output(s, so)
        del output.num_nans_in_logits["a"]
        s.update_from_output(so, output)
    assert s.kvguard_stats()["blocks_quarantined"] == len(freed)
    # Quarantined blocks are reused first, zeroed before the step that writes them.
    so, _ = step(s)
    assert so.new_block_ids_to_zero and set(so.new_block_ids_to_zero) <= set(freed)
    s.kvguard_pool.check_consistency()


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("groups", FREEING)
def test_clean_trace_same_decisions_as_stock_vllm(
    groups: tuple[str, ...], async_scheduling: bool
) -> None:
    arrivals = shared_prefix_arrivals(11, 10, 4 * BLOCK, (10, 40))
    runs: list[list[object]] = []
    for guarded in (False, True):
        s = make_scheduler(
            guarded=guarded, groups=groups, async_scheduling=async_scheduling, num_blocks=48
        )
        trace = decision_trace(s, arrivals, 90, async_scheduling=async_scheduling)
        if guarded:
            assert s.kvguard_stats()["blocks_quarantined"] == 0
            assert s.kvguard_stats()["blocks_zeroed"] == 0
            s.kvguard_pool.check_consistency()
        runs.append(trace)
    assert runs[0] == runs[1]
    assert any(h for entry in runs[0] if isinstance(entry, tuple) for h in entry[2].values())


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("groups", [("rswa",), ("full", "rswa")])
def test_r_swa_gap_blocks_freed_after_clean_steps_are_not_quarantined(
    groups: tuple[str, ...], prefix_caching: bool
) -> None:
    """R-SWA keeps the prompt and the last ``window`` generated tokens: the decode
    blocks between them are freed as decoding moves on, after clean steps without
    quarantine -- published ones stay reusable, unpublished ones (prefix caching off)
    are freed plainly -- while the prompt's blocks stay held."""
    s = make_scheduler(groups=groups, prefix_caching=prefix_caching)
    s.add_request(make_request("a", PROMPT, max_tokens=120))
    step(s)
    step(s)  # the prompt's two prefill chunks
    prompt_blocks = list(_windowed_table(s, "a"))[: len(PROMPT) // BLOCK]
    core = s.kvguard_pool.core
    freed: list[int] = []
    states: set[BlockState] = set()
    for _ in range(100):
        before = list(_windowed_table(s, "a"))
        step(s)
        now = _window_freed(s, "a", before)
        freed += now
        states.update(core.block_state(b) for b in now)
    table = _windowed_table(s, "a")
    assert table[: len(prompt_blocks)] == prompt_blocks  # never freed
    gap = [i for i, b in enumerate(table) if b == NULL]
    assert gap and gap[0] == -(-len(PROMPT) // BLOCK), "no gap block was freed"
    assert len(freed) == len(gap)
    if prefix_caching:
        assert states == {BlockState.PUBLISHED}
    # (Unpublished ones go back FREE and are handed straight back to a's next block.)
    stats = s.kvguard_stats()
    assert stats["blocks_quarantined"] == 0 and stats["blocks_zeroed"] == 0
    s.kvguard_pool.check_consistency()


@pytest.mark.parametrize("windowed", ["sliding", "chunked"])
@pytest.mark.parametrize("fail", [False, True])
def test_hybrid_model_with_the_guarded_offloading_connector(fail: bool, windowed: str) -> None:
    """Stores cover validated blocks only, and the window frees that vLLM makes before
    handing a finished request to the connector quarantine nothing after clean steps."""
    from .exit_rule import assert_may_leave
    from .harness import connector_output as output
    from .harness import transfer_config
    from .test_offloading import store_blocks

    s = make_scheduler(groups=("full", windowed), kv_transfer_config=transfer_config())
    s.add_request(make_request("a", PROMPT, max_tokens=12))
    core = s.kvguard_pool.core
    completed: list[int] = []
    reasons: dict[str, str] = {}
    for t in range(20):
        so = s.schedule()
        for blocks in store_blocks(so).values():
            assert_may_leave(core, blocks)
        nans = {"a": 1} if fail and t == 8 else None
        out = s.update_from_output(so, output(s, so, nans, completed=completed))
        completed = list(store_blocks(so))
        reasons.update(finish_reasons(out))
        s.kvguard_pool.check_consistency()
    assert reasons == {"a": "error" if fail else "length"}
    stats = s.kvguard_stats()
    assert stats["offload_chunks_stored"] > 0
    assert stats["blocks_quarantined"] == (2 if fail else 0)  # a's partial tails


def test_a_window_free_of_blocks_a_step_in_flight_fills_is_caught() -> None:
    """vLLM frees below the processed tokens only; with check_invariants on, a window
    free of a block whose filling step is still in flight (whose output would then
    validate a freed block) is an error."""
    s = make_scheduler(groups=("sliding",), async_scheduling=True, max_num_batched_tokens=BLOCK)
    s.add_request(make_request("a", PROMPT))
    s.schedule()
    s.schedule()  # two prefill chunks in flight, each filling a block
    with pytest.raises(EngineContractError, match="a step in flight fills"):
        s.kv_cache_manager.coordinator.remove_skipped_blocks("a", len(PROMPT))


def test_a_window_free_of_blocks_a_step_in_flight_fills_quarantines_them() -> None:
    """The same broken contract without ``check_invariants``: the freed blocks are
    quarantined, not validated, and the steps in flight forget them -- their outputs,
    clean, validate nothing freed."""
    s = make_scheduler(
        groups=("sliding",),
        async_scheduling=True,
        max_num_batched_tokens=BLOCK,
        kvguard={"check_invariants": False},
    )
    s.add_request(make_request("a", PROMPT))
    so1 = s.schedule()
    so2 = s.schedule()  # two prefill chunks in flight, each filling a block
    filled = list(_windowed_table(s, "a"))[:2]
    s.kv_cache_manager.coordinator.remove_skipped_blocks("a", len(PROMPT))
    freed = _window_freed(s, "a", filled)
    assert freed == filled
    core = s.kvguard_pool.core
    assert {core.block_state(b) for b in freed} == {BlockState.QUARANTINED}
    for so in (so1, so2):
        s.update_from_output(so, model_output(s, so))
    assert {core.block_state(b) for b in freed} == {BlockState.QUARANTINED}
    assert s.kvguard_stats()["window_contract_breaks"] == 1
    s.kvguard_pool.check_consistency()


LOCAL = [("chunked",), ("full", "chunked")]
SHORT = list(range(6000, 6040))  # 2.5 blocks: decoding reaches the local chunk's end


def _drive_async(
    s: Any, steps: int, uncounted_at: int | None = None
) -> tuple[list[tuple[int, int]], dict[str, str]]:
    """Async steps of request "a" (one output in flight). Returns the blocks each
    schedule's local-chunk free took while the step that cached them was in flight,
    as (step, block id), and the finish reasons. The output processed at step
    ``uncounted_at`` carries no NaN count for "a"."""
    ledger = s._kvguard_ledger
    caught: list[tuple[int, int]] = []
    reasons: dict[str, str] = {}
    pending = []
    for t in range(steps):
        running = "a" in s.requests
        in_flight = set(ledger.fills_in_flight("a"))
        before = list(_windowed_table(s, "a")) if running else []
        pending.append(s.schedule())
        if running:
            caught += [(t, b) for b in _window_freed(s, "a", before) if b in in_flight]
        if len(pending) == 2:
            done = pending.pop(0)
            output = model_output(s, done)
            if t == uncounted_at:
                del output.num_nans_in_logits["a"]
            reasons.update(finish_reasons(s.update_from_output(done, output)))
        s.kvguard_pool.check_consistency()
    return caught, reasons


@pytest.mark.parametrize("groups", LOCAL)
def test_local_chunk_end_frees_a_block_whose_caching_step_is_in_flight(
    groups: tuple[str, ...],
) -> None:
    """Under async scheduling vLLM caches a block one step after the step that
    completed it, and a local chunk's end can free the block while that step is in
    flight. Every write into it reported clean: it is validated and published as it
    is freed, and the in-flight step's output validates nothing of it."""
    s = make_scheduler(groups=groups, async_scheduling=True)
    s.add_request(make_request("a", SHORT, max_tokens=20))
    caught, reasons = _drive_async(s, 25)
    assert caught, "no local chunk end freed a block of an in-flight step"
    assert reasons == {"a": "length"}
    core = s.kvguard_pool.core
    for _, block_id in caught:
        info = core.block_info(block_id)
        assert info.state is BlockState.PUBLISHED and info.ref_cnt == 0
    stats = s.kvguard_stats()
    assert stats["blocks_quarantined"] == 0 and stats["blocks_zeroed"] == 0


@pytest.mark.parametrize("groups", LOCAL)
def test_local_chunk_end_after_an_unchecked_step_quarantines_and_the_step_forgets_it(
    groups: tuple[str, ...],
) -> None:
    """The same free when the request's last reported step had no NaN count: the block
    is quarantined, and the clean output of the in-flight step that cached it does not
    validate it (it may be another request's by then)."""
    probe = make_scheduler(groups=groups, async_scheduling=True)
    probe.add_request(make_request("a", SHORT, max_tokens=20))
    ((t, _),) = _drive_async(probe, 25)[0]
    s = make_scheduler(groups=groups, async_scheduling=True)
    s.add_request(make_request("a", SHORT, max_tokens=20))
    # The output processed just before schedule t is the last one reported then.
    caught, reasons = _drive_async(s, 25, uncounted_at=t - 1)
    assert [step for step, _ in caught] == [t]
    assert reasons == {"a": "length"}
    core = s.kvguard_pool.core
    for _, block_id in caught:
        assert core.block_state(block_id) is BlockState.QUARANTINED
    assert s.kvguard_stats()["steps_unchecked"] == 1
