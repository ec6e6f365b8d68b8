"""Hybrid models (a Mamba / gated-delta-net state group beside attention) on vLLM's real
scheduler and ``MambaManager``, guarded: a state checkpoint is published only once the
step that wrote it validated, a failed step's checkpoint is quarantined and zeroed before
reuse, a same-prefix request hits exactly the validated prefix -- and partial-block
prefix hits (``hash_block_size < block_size``) run guarded, hitting whole blocks.

The real engine (a tiny gated-delta-net and Mamba2 hybrid on vLLM's CPU build) is
tested in ``tests/e2e/test_hybrid.py``.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from kvguard import BlockState  # noqa: E402
from kvguard.adapters.vllm.pool.block_pool import PartialEntryError  # noqa: E402
from kvguard.errors import PoolMisuseError  # noqa: E402

from . import harness  # noqa: E402
from .harness import (  # noqa: E402
    BLOCK,
    finish_reasons,
    hit_tokens,
    make_request,
    make_scheduler,
    model_output,
    step,
)

HYBRID = ("mamba", "full")
PROMPT = list(range(3000, 3000 + 8 * BLOCK + 5))
"""Eight full blocks and a tail: prefill chunks of 64 tokens (four blocks) each, so
Mamba's state is cached at 64 and at 128."""


def repeated_prompt_arrivals(seed: int, requests: int) -> harness.Arrivals:
    """A clean trace's arrivals: one request every 4 steps, each one of two prompts of
    four blocks and a few tokens, or a random one (a Mamba state is cached where a
    step's computation ends on a block boundary, so hits come from repeated prompts)."""
    rng = random.Random(seed)
    shared = [list(range(p, p + 4 * BLOCK + 3)) for p in (9000, 9500)]
    arrivals = {}
    for i in range(requests):
        prompt = rng.choice([*shared, [rng.randrange(50_000) for _ in range(3 * BLOCK)]])
        arrivals[4 * i] = (f"r{i}", prompt, rng.randrange(3, 12))
    return arrivals


def _mamba_blocks(s: Any, req_id: str) -> list[int]:
    return [b for b in s.kv_cache_manager.get_block_ids(req_id)[0] if b]


def _core(s: Any) -> Any:
    return s.kvguard_pool.core


# ---------------------------------------------------------------- clean traces


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["align", "none"])
def test_clean_trace_same_decisions_as_stock_vllm(
    prefix_caching: bool, async_scheduling: bool
) -> None:
    arrivals = repeated_prompt_arrivals(7, 10)
    runs = []
    for guarded in (False, True):
        s = make_scheduler(
            guarded=guarded,
            groups=HYBRID,
            prefix_caching=prefix_caching,
            async_scheduling=async_scheduling,
            num_blocks=64,
        )
        runs.append(harness.decision_trace(s, arrivals, 70, async_scheduling=async_scheduling))
        if guarded:
            assert s.kvguard_stats()["blocks_quarantined"] == 0
            s.kvguard_pool.check_consistency()
    assert runs[0] == runs[1]
    hits = [h for entry in runs[0] if isinstance(entry, tuple) for h in entry[2].values()]
    assert any(hits) is prefix_caching


# ---------------------------------------------------------------- publication


def test_a_checkpoint_is_matchable_only_after_its_step_validated() -> None:
    s = make_scheduler(groups=HYBRID)
    s.add_request(make_request("a", PROMPT, max_tokens=4))
    so = s.schedule()  # the first chunk: blocks 0..3, Mamba's state at 64 in block 3
    state = _mamba_blocks(s, "a")[-1]
    pool = s.kvguard_pool
    assert _core(s).block_state(state) is BlockState.WRITTEN
    assert pool.blocks[state].block_hash is None  # vLLM has cached it; kvguard holds it
    s.update_from_output(so, model_output(s, so))
    assert _core(s).block_state(state) is BlockState.PUBLISHED
    assert pool.blocks[state].block_hash is not None
    pool.check_consistency()


def test_under_async_scheduling_the_next_step_cannot_hit_a_checkpoint_in_flight() -> None:
    s = make_scheduler(groups=HYBRID, async_scheduling=True)
    s.add_request(make_request("a", PROMPT, max_tokens=4))
    first = s.schedule()
    s.add_request(make_request("b", PROMPT[: 4 * BLOCK + 3], max_tokens=2))
    second = s.schedule()
    assert hit_tokens(second).get("b", 0) == 0  # a's checkpoint at 64 is still in flight
    s.update_from_output(first, model_output(s, first))
    s.update_from_output(second, model_output(s, second))
    s.kvguard_pool.check_consistency()


# ---------------------------------------------------------------- faults


def _nan_in_second_chunk(guarded: bool, async_scheduling: bool) -> tuple[Any, set[int]]:
    """Request a computes PROMPT in two chunks; the second reports NaN for it (guarded).
    Returns the scheduler (every output processed) and the Mamba blocks the second
    chunk wrote."""
    s = make_scheduler(guarded=guarded, groups=HYBRID, async_scheduling=async_scheduling)
    s.add_request(make_request("a", PROMPT, max_tokens=8))
    s.add_request(make_request("bystander", list(range(8000, 8020)), max_tokens=8))
    pending = []
    written: set[int] = set()
    for t in range(4):
        so = s.schedule()
        if t == 1:
            written = set(_mamba_blocks(s, "a"))
        pending.append((t, so))
        if not async_scheduling or len(pending) == 2:
            done_t, done = pending.pop(0)
            nans = {"a": 3} if guarded and done_t == 1 else None
            s.update_from_output(done, model_output(s, done, nans))
    for _, done in pending:
        s.update_from_output(done, model_output(s, done))
    return s, written


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_nan_in_a_prefill_chunk_aborts_it_alone_and_quarantines_its_checkpoints(
    async_scheduling: bool,
) -> None:
    s, written = _nan_in_second_chunk(True, async_scheduling)
    assert "a" not in s.requests and "bystander" in s.requests
    core = _core(s)
    first_chunk_state = min(written)  # the state at 64, validated with the first chunk
    poisoned = written - {first_chunk_state}
    assert poisoned
    assert all(core.block_state(b) is BlockState.QUARANTINED for b in poisoned)
    assert core.block_state(first_chunk_state) is BlockState.PUBLISHED
    # The next request is handed quarantined blocks first, zeroed before its step.
    quarantined = {
        b
        for b in range(1, len(s.kvguard_pool.blocks))
        if core.block_state(b) is BlockState.QUARANTINED
    }
    s.add_request(make_request("c", list(range(20000, 20000 + 3 * BLOCK)), max_tokens=2))
    so = s.schedule()
    reused = {b for group in s.kv_cache_manager.get_block_ids("c") for b in group} & quarantined
    assert reused and reused <= set(so.new_block_ids_to_zero or [])
    s.update_from_output(so, model_output(s, so))
    s.kvguard_pool.check_consistency()


@pytest.mark.parametrize("guarded", [False, True], ids=["stock", "guarded"])
def test_a_same_prefix_request_hits_exactly_the_validated_prefix(guarded: bool) -> None:
    """Stock vLLM hands the next same-prefix request the state the failed chunk wrote
    (its checkpoint at 128); guarded, it hits the state at 64 and recomputes the rest."""
    s, _ = _nan_in_second_chunk(guarded, async_scheduling=False)
    s.add_request(make_request("b", PROMPT, max_tokens=2))
    so, out = step(s)
    assert hit_tokens(so) == {"b": 4 * BLOCK if guarded else 8 * BLOCK}
    assert "b" not in finish_reasons(out)


# ---------------------------------------------------------------- entries


TAIL_PROMPT = PROMPT[: 5 * BLOCK + 4]
"""84 tokens, blocks of 32, a prefix-match unit of 16: vLLM's align mode computes 0..63
(two whole blocks), then 64..79, up to the prompt's last prefix-match boundary, and
registers the state at 80 -- in block 2, which the request goes on writing -- as an
entry inside the block (``cache_partial_block``); then 80..83."""


def _tail_scheduler() -> Any:
    s = make_scheduler(
        groups=HYBRID, block_size=2 * BLOCK, hash_block_size=BLOCK, max_num_batched_tokens=256
    )
    s.add_request(make_request("a", TAIL_PROMPT, max_tokens=4))
    step(s)  # 0..63
    return s


def _tail(s: Any) -> tuple[Any, bytes]:
    """The running Mamba block of a, once vLLM registered the state at 80 in it, and
    the key vLLM was given for that entry."""
    pool = s.kvguard_pool
    running = pool.blocks[_mamba_blocks(s, "a")[-1]]
    tail = pool.tails[running.block_id]
    assert tail.num_tokens == 5 * BLOCK and not tail.on_release
    return running, tail.publication[0]


def test_an_entry_inside_a_running_block_is_held_not_matchable() -> None:
    """A prompt's tail inside a block its request still writes: registered (vLLM gets
    its key) but not matchable, also once the step that computed it validated."""
    s = _tail_scheduler()
    step(s)  # 64..79: vLLM registers the state at 80
    pool = s.kvguard_pool
    request = s.requests["a"]
    running, key = _tail(s)
    assert key == request.block_hashes[4] + bytes(4)
    assert running.block_hash is None
    assert pool.get_cached_block(request.block_hashes[4], [0]) is None
    # Again: vLLM is handed the same key, nothing changes.
    assert pool.cache_partial_block(request, running, 5 * BLOCK, 0, 2 * BLOCK) == key
    assert pool.get_cached_block(request.block_hashes[4], [0]) is None
    pool.check_consistency()


@pytest.mark.parametrize("num_tokens", [70, 6 * BLOCK, 0])
def test_an_entry_at_no_prefix_boundary_is_a_typed_error_and_changes_nothing(
    num_tokens: int,
) -> None:
    """Off the prefix-match unit, past the request's hashes, or empty: vLLM's pool
    asserts; kvguard's raises its misuse error (an AssertionError too) and registers
    nothing."""
    s = _tail_scheduler()
    pool = s.kvguard_pool
    running = pool.blocks[_mamba_blocks(s, "a")[-1]]
    before = _core(s).snapshot()
    with pytest.raises(PartialEntryError, match=f"num_tokens={num_tokens}\\)"):
        pool.cache_partial_block(s.requests["a"], running, num_tokens, 0, 2 * BLOCK)
    assert issubclass(PartialEntryError, PoolMisuseError)
    assert issubclass(PartialEntryError, AssertionError)
    assert _core(s).snapshot() == before and not pool.tails
    pool.check_consistency()


def test_a_checkpoint_exported_into_a_published_block_unpublishes_it() -> None:
    s = make_scheduler(groups=HYBRID)
    s.add_request(make_request("a", PROMPT, max_tokens=4))
    step(s)
    pool = s.kvguard_pool
    state = pool.blocks[_mamba_blocks(s, "a")[-1]]  # the state at 64, published
    published = state.block_hash
    assert published is not None
    assert pool.cache_partial_block(s.requests["a"], state, 3 * BLOCK, 0, BLOCK, True) is None
    assert _core(s).block_state(state.block_id) is BlockState.QUARANTINED
    assert pool.get_cached_block(published[:-4], [0]) is None
    pool.check_consistency()


def _vllm_moves_the_tail(pool: Any, src: Any) -> Any:
    """What vLLM's MambaManager does for a producer's tail on its next allocation: a
    new block takes the entry and a copy, both kept until the copy ran."""
    (dst,) = pool.get_new_blocks(1)
    pool.move_block_hashes(src, dst)
    src.ref_cnt += 1
    pool.retain_for_copy(src)  # (the guarded allocation's wrapper, once vLLM returns)
    return dst


def test_a_mamba_tail_moves_to_its_copy_published_once_its_state_validated() -> None:
    s = _tail_scheduler()
    step(s)  # 64..79, validated: the state at 80 is clean
    pool = s.kvguard_pool
    src, key = _tail(s)
    dst = _vllm_moves_the_tail(pool, src)
    pool.free_blocks([src, dst])  # vLLM: the copy ran
    # Published before vLLM released it (the scheduler took the pool's outbox first).
    assert dst.block_hash == key and _core(s).block_state(dst.block_id) is BlockState.PUBLISHED
    assert src.ref_cnt == 1 and _core(s).block_state(src.block_id) is BlockState.WRITTEN
    assert pool.get_cached_block(key[:-4], [0]) == [dst]
    pool.check_consistency()


def test_a_mamba_tail_whose_state_is_in_flight_is_not_moved() -> None:
    """Under async scheduling vLLM copies the state while the step that computed it is
    still in flight: the entry goes, and the copy -- released before that step reports
    -- is quarantined."""
    s = _tail_scheduler()
    so = s.schedule()  # 64..79, in flight
    pool = s.kvguard_pool
    src, key = _tail(s)
    dst = _vllm_moves_the_tail(pool, src)
    pool.free_blocks([src, dst])
    assert dst.block_hash is None and src.ref_cnt == 1
    assert _core(s).block_state(dst.block_id) is BlockState.QUARANTINED
    assert pool.get_cached_block(key[:-4], [0]) is None
    s.update_from_output(so, model_output(s, so))
    pool.check_consistency()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_attention_tail_is_published_when_its_request_leaves_after_clean_steps(
    async_scheduling: bool,
) -> None:
    """A Mamba2-like group exports its state at the prompt's last boundary (80) into a
    block of its own; attention registers its tail there. Guarded, a same-prompt
    request hits 80 once the first has left after clean steps (stock: as soon as the
    tail is registered); with a NaN in the first request's step, it hits nothing."""
    for guarded, during, nan, expected in [
        (False, True, False, 5 * BLOCK),
        (True, True, False, 0),
        (True, False, False, 5 * BLOCK),
        (True, False, True, 0),
    ]:
        s = make_scheduler(
            guarded=guarded,
            groups=("mamba2", "full"),
            block_size=2 * BLOCK,
            hash_block_size=BLOCK,
            max_num_batched_tokens=256,
            async_scheduling=async_scheduling,
        )
        s.add_request(make_request("a", TAIL_PROMPT, max_tokens=3))
        pending: list[tuple[int, Any]] = []
        hits: dict[str, int] = {}
        for t in range(8):
            if t == (2 if during else 6):
                s.add_request(make_request("b", TAIL_PROMPT, max_tokens=2))
            so = s.schedule()
            hits.update(hit_tokens(so))
            pending.append((t, so))
            if not async_scheduling or len(pending) == 2:
                done_t, done = pending.pop(0)
                s.update_from_output(
                    done, model_output(s, done, {"a": 1} if nan and done_t == 0 else None)
                )
        for _, done in pending:
            s.update_from_output(done, model_output(s, done))
        assert hits["b"] == expected, (guarded, during, nan)
        if guarded:
            s.kvguard_pool.check_consistency()


def test_a_checkpoint_taken_back_before_validation_is_never_published() -> None:
    s = make_scheduler(groups=HYBRID)
    s.add_request(make_request("a", PROMPT, max_tokens=4))
    so = s.schedule()
    pool = s.kvguard_pool
    state = pool.blocks[_mamba_blocks(s, "a")[-1]]
    assert pool._maybe_evict_cached_block(state)  # vLLM: a transient state overwrites it
    assert not pool._maybe_evict_cached_block(state)
    s.update_from_output(so, model_output(s, so))
    assert _core(s).block_state(state.block_id) is BlockState.VALIDATED
    assert state.block_hash is None
    pool.check_consistency()


def test_a_published_checkpoint_taken_back_is_quarantined() -> None:
    s = make_scheduler(groups=HYBRID)
    s.add_request(make_request("a", PROMPT, max_tokens=4))
    step(s)
    pool = s.kvguard_pool
    state = pool.blocks[_mamba_blocks(s, "a")[-1]]
    key = state.block_hash
    assert key is not None
    assert pool._maybe_evict_cached_block(state)
    assert _core(s).block_state(state.block_id) is BlockState.QUARANTINED
    assert pool.get_cached_block(key[:-4], [0]) is None
    pool.check_consistency()


def test_a_checkpoint_rekeyed_to_its_own_boundary_keeps_its_held_key() -> None:
    s = make_scheduler(groups=HYBRID)
    s.add_request(make_request("a", PROMPT, max_tokens=4))
    so = s.schedule()
    pool = s.kvguard_pool
    request = s.requests["a"]
    state = pool.blocks[_mamba_blocks(s, "a")[-1]]
    key = pool.cache_partial_block(request, state, 4 * BLOCK, 0, BLOCK, True)
    assert key is not None
    s.update_from_output(so, model_output(s, so))
    assert state.block_hash == key
    pool.check_consistency()


# ---------------------------------------------------------------- partial-block hits


@pytest.mark.parametrize(
    ("groups", "chunk"),
    # Mamba caches states where a step ends on a block: 64-token chunks; Mamba2 also
    # at the prompt's last boundary inside one: whole prompts in a step.
    [(HYBRID, 64), (("mamba2", "full"), 256)],
    ids=["mamba", "mamba2"],
)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_partial_block_prefix_hits_clean_trace_runs_guarded(
    async_scheduling: bool, groups: tuple[str, ...], chunk: int
) -> None:
    """``hash_block_size`` (16) below the block size (32): vLLM's prefix-match unit is
    finer than its blocks. Guarded, every request finishes, nothing is quarantined,
    and the hits are stock's or fewer (an entry inside a block is published later)."""
    arrivals = repeated_prompt_arrivals(11, 10)
    hits = {}
    for guarded in (False, True):
        s = make_scheduler(
            guarded=guarded,
            groups=groups,
            block_size=2 * BLOCK,
            hash_block_size=BLOCK,
            async_scheduling=async_scheduling,
            num_blocks=64,
            max_num_batched_tokens=chunk,
        )
        assert s.kv_cache_manager.coordinator.enable_partial_hash_hits
        trace = harness.decision_trace(s, arrivals, 60, async_scheduling=async_scheduling)
        hits[guarded] = [
            h for entry in trace if isinstance(entry, tuple) for h in entry[2].values()
        ]
        finished = [r for entry in trace if isinstance(entry, dict) for r in entry]
        assert len(finished) == 10
        if guarded:
            assert s.kvguard_stats()["blocks_quarantined"] == 0
            s.kvguard_pool.check_consistency()
    assert any(hits[True])
    assert sum(hits[True]) <= sum(hits[False])


def test_recover_ends_a_request_with_mamba_state_rather_than_resume_it() -> None:
    s = make_scheduler(groups=HYBRID)
    s.add_request(make_request("a", PROMPT, max_tokens=10))
    step(s)
    s.schedule()  # the second chunk, whose output is lost
    report = s.recover()
    assert not report.resumed
    [(request, why)] = report.ended
    assert request.request_id == "a" and "Mamba state" in why
    s.kvguard_pool.check_consistency()
