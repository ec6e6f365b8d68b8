"""The guard in a real vLLM engine (in-process: engine core in the test process), each
scenario run on stock vLLM and on the guarded engine side by side.

Every scenario uses prompts of its own (``tokens(seed, n)``), so the engines' prefix
caches connect scenarios only where a test says so. The reference engine (faults off)
gives the fault-free output of every prompt.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import HAVE_ENGINE, SKIP_REASON

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not HAVE_ENGINE, reason=SKIP_REASON)]

if HAVE_ENGINE:
    from .conftest import guard_in_this_process, in_process, kvguard_log, shutdown
    from .engine import (
        BLOCK,
        BLOCK_ZEROING,
        ENGINE_KWARGS,
        SERIES,
        Result,
        blocks_in_state,
        faults_fired,
        generate,
        matchable_blocks,
        non_finite_blocks,
        read_blocks,
        tokens,
        trigger,
        watch_steps,
        with_token,
    )


START_UP_LOG: dict[str, list[Any]] = {}
"""What kvguard logged while each engine was built (its ``LogRecord``s)."""


@pytest.fixture(scope="module")
def stock(model_dir: str, reference: Any) -> Iterator[Any]:
    """Stock vLLM: its own scheduler and pool, no kvguard plugin in force."""
    from vllm import LLM

    with in_process(), kvguard_log() as START_UP_LOG["stock"]:
        llm = LLM(model=model_dir, **ENGINE_KWARGS)
    assert type(llm.llm_engine.engine_core.engine_core.scheduler).__name__ == "Scheduler"
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def guarded(model_dir: str, reference: Any, stock: Any) -> Iterator[Any]:
    """The same engine with kvguard's plugin in force (``KVGUARD_GUARD=1``)."""
    from vllm import LLM

    with guard_in_this_process():
        with in_process(), kvguard_log() as START_UP_LOG["guarded"]:
            llm = LLM(model=model_dir, **ENGINE_KWARGS)
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        assert type(sched).__name__ == "GuardedScheduler"
        assert sched.kvguard_pool.core is not None
        yield llm
        shutdown(llm)


def both(stock: Any, guarded: Any) -> list[tuple[str, Any]]:
    return [("stock", stock), ("guarded", guarded)]


# ---------------------------------------------------------------- prefill chunk 2


def test_nan_in_prefill_chunk_2_aborts_only_that_request(
    reference: Any, stock: Any, guarded: Any
) -> None:
    """A's second prefill chunk (positions 64..127) computes NaN. B, submitted with A,
    shares A's first 128 tokens; C, submitted after A ended, too.

    Stock vLLM caches A's chunk-2 blocks while scheduling that step: A delivers tokens
    sampled from NaN logits with finish reason "length", and B and C hit A's NaN
    blocks and deliver garbage. Guarded: A ends with "error" and delivers nothing; B
    and C hit only A's validated first chunk and produce the fault-free output."""
    prompt = tokens(1, 158)
    a = with_token(prompt, 84, trigger(0))  # NaN from position 84: chunk 2
    b = a[:128] + tokens(2, 30)
    c = a[:128] + tokens(3, 30)
    ref_a, ref_b, ref_c = generate(reference, [a, b, c])
    assert ref_a.finish_reason == "length" and len(ref_a.token_ids) == 8

    out: dict[str, tuple[Result, Result, Result]] = {}
    for name, llm in both(stock, guarded):
        a_out, b_out = generate(llm, [a, b])
        (c_out,) = generate(llm, [c])
        assert (84, trigger(0)) in faults_fired(llm), name
        out[name] = (a_out, b_out, c_out)

    a_out, b_out, c_out = out["stock"]
    assert a_out.finish_reason == "length"
    assert a_out.token_ids != ref_a.token_ids  # sampled from NaN logits, delivered
    assert b_out.num_cached_tokens == 128  # A's unchecked chunk-2 blocks
    assert b_out.token_ids != ref_b.token_ids
    assert c_out.num_cached_tokens == 128
    assert c_out.token_ids != ref_c.token_ids

    a_out, b_out, c_out = out["guarded"]
    assert a_out.finish_reason == "error"
    assert a_out.token_ids == ()  # nothing sampled from NaN logits reaches the client
    assert b_out.num_cached_tokens == 64  # A's first chunk: its step validated
    assert b_out == Result(ref_b.token_ids, "length", 64)
    # C hits B's recomputed chunk-2 blocks (B's steps validated), not A's.
    assert c_out == Result(ref_c.token_ids, "length", 128)


def test_retry_hits_exactly_the_validated_prefix(reference: Any, stock: Any, guarded: Any) -> None:
    """A request fails in its second prefill chunk; the same request again (the fault
    was transient) hits the blocks of its first chunk only, and gets the fault-free
    output. Stock: the retry hits the NaN chunk too, and gets garbage."""
    a = with_token(tokens(10, 150), 70, trigger(0))
    (ref,) = generate(reference, [a])
    retries = {}
    for name, llm in both(stock, guarded):
        (first,) = generate(llm, [a])
        (retry,) = generate(llm, [a])
        assert first.token_ids != ref.token_ids, name
        retries[name] = retry
    assert retries["stock"].num_cached_tokens == 128
    assert retries["stock"].token_ids != ref.token_ids
    assert retries["guarded"] == Result(ref.token_ids, "length", 64)


# ---------------------------------------------------------------- the KV tensors


def test_quarantined_blocks_are_zeroed_before_reuse(
    reference: Any, stock: Any, guarded: Any
) -> None:
    """Read the worker's KV cache. A (one output token) fails in chunk 2 (positions
    64..125: one full block, one holding 30 of 32 slots); R then needs one new block
    (its first block is a prefix hit) and writes 11 of its slots (8 prompt tokens, 3
    computed decode tokens).

    Stock: A's full NaN block stays matchable, and R is handed A's partial block
    unwiped: after R, the 19 of A's 30 slots that R does not write still hold A's
    NaN. Guarded: A's two blocks are quarantined (NaN in the tensors, never
    matchable); R is handed one of them, the scheduler tells the worker to zero it,
    and after R it holds no NaN."""
    w = tokens(20, 40)
    a = with_token(tokens(21, 126), 80, trigger(0))
    r = w[:BLOCK] + tokens(22, 8)
    (ref_r,) = generate(reference, [r], max_tokens=4)
    for name, llm in both(stock, guarded):
        generate(llm, [w])  # w's first block: a validated, matchable prefix for R
        log = watch_steps(llm)
        (a_out,) = generate(llm, [a], max_tokens=1)  # stock: no decode step after it
        (a_blocks,) = log.new_blocks.values()
        nan_blocks = non_finite_blocks(llm, a_blocks)
        assert nan_blocks == set(a_blocks[2:4]), (name, a_blocks)  # the NaN reached KV
        log.new_blocks.clear()
        before = read_blocks(llm, nan_blocks)
        (r_out,) = generate(llm, [r], max_tokens=4)
        assert r_out.num_cached_tokens == BLOCK, name
        (r_blocks,) = log.new_blocks.values()
        (r_new,) = r_blocks[1:]
        after = read_blocks(llm, [r_new])[r_new]
        if name == "stock":
            assert a_out.finish_reason == "length"
            assert matchable_blocks(llm) & nan_blocks  # A's full NaN block is a hit
            assert r_new in nan_blocks  # A's partial block, reused ...
            assert 0 < after.non_finite < before[r_new].non_finite  # ... unwiped: R
            # overwrote the slots it wrote; A's NaN stays in the others
        else:
            assert a_out.finish_reason == "error"
            assert nan_blocks <= blocks_in_state(llm, "QUARANTINED") | {r_new}
            assert not matchable_blocks(llm) & nan_blocks
            assert r_new in nan_blocks  # quarantined blocks are reused first ...
            assert any(r_new in sent for sent in log.zeroed)  # ... zeroed first
            assert after.non_finite == 0
            assert r_out == Result(ref_r.token_ids, "length", BLOCK)


def test_no_matchable_block_holds_a_non_finite_value(stock: Any, guarded: Any) -> None:
    """After a NaN in a prompt's second chunk (and whatever other tests ran on the
    engines before): the stock engine's prefix cache serves NaN KV, the guarded
    engine's serves none (a scan of the whole KV cache)."""
    a = with_token(tokens(50, 158), 100, trigger(0))  # (a position of its own)
    for llm in (stock, guarded):
        generate(llm, [a])
    assert matchable_blocks(stock) & non_finite_blocks(stock)
    assert matchable_blocks(guarded)
    assert not matchable_blocks(guarded) & non_finite_blocks(guarded)


# ---------------------------------------------------------------- decode


def test_nan_in_decode_aborts_and_keeps_the_tokens_before_it(
    reference: Any, stock: Any, guarded: Any
) -> None:
    """The fault fires at position 43 of a 40-token prompt: the decode step that
    samples output token 4. Stock delivers its tokens 4.. from NaN logits; guarded
    delivers tokens 0..3 (each from clean logits) and ends with "error"."""
    d = with_token(tokens(30, 40), 10, trigger(33))  # position 10 + 33 = 43
    (ref,) = generate(reference, [d])
    (stock_out,) = generate(stock, [d])
    (guarded_out,) = generate(guarded, [d])
    assert stock_out.token_ids[:4] == ref.token_ids[:4]
    assert stock_out.token_ids[4:] != ref.token_ids[4:]
    assert stock_out.finish_reason == "length"
    assert guarded_out.token_ids == ref.token_ids[:4]
    assert guarded_out.finish_reason == "error"
    (retry,) = generate(guarded, [d])
    assert retry == Result(ref.token_ids, "length", BLOCK)  # the prompt's full block


# ---------------------------------------------------------------- what the log says


def test_the_log_says_the_guard_is_in_force_and_names_each_aborted_request(
    reference: Any, stock: Any, guarded: Any
) -> None:
    """vLLM's log, kvguard's lines: the guarded engine said once, at INFO, as it
    started that the guard is in force, with its one worker checked; it names each
    request it aborts at WARNING -- its id (the client's id and vLLM's suffix), the
    positions its failing step computed (A's second prefill chunk, 64..127), the NaN
    count. The clean request beside it is not named. Stock logs nothing of kvguard's,
    and delivers A's NaN-derived tokens."""
    import logging

    from vllm import SamplingParams, TokensPrompt

    assert START_UP_LOG["stock"] == []
    (start,) = START_UP_LOG["guarded"]
    assert start.levelno == logging.INFO
    assert start.getMessage().startswith(f"kvguard: guard in force (vLLM 0.{SERIES[1]}.")
    assert start.getMessage().endswith(
        "GuardedScheduler): workers checked: 1 OK; zero policy: suspect (block zeroing: "
        f"{BLOCK_ZEROING}); KV audit: off; seals: off; prefix caching: on; "
        "connectors gated: none; KV cache groups guarded: 1 (FullAttentionSpec)"
    )

    a = with_token(tokens(40, 150), 90, trigger(0))  # NaN from position 90: chunk 2
    b = tokens(41, 40)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=a), TokensPrompt(prompt_token_ids=b)]
    for name, llm in both(stock, guarded):
        with kvguard_log() as records:
            a_out, b_out = llm.generate(prompts, params, use_tqdm=False)
        if name == "stock":
            assert records == []
            assert a_out.outputs[0].finish_reason == "length"
            continue
        assert a_out.outputs[0].finish_reason == "error"
        (abort,) = records
        assert abort.levelno == logging.WARNING
        line = abort.getMessage()
        match = re.fullmatch(
            r"kvguard: aborted request (\S+) \(finish reason 'error'\): the step computing "
            r"its positions 64\.\.127 \(prompt 150 tokens, 0 output token\(s\)\) had "
            r"(\d+) NaN logit\(s\); its tokens are not delivered, .*",
            line,
        )
        assert match, line
        assert match.group(1).startswith(a_out.request_id + "-"), (line, a_out.request_id)
        assert int(match.group(2)) > 0
        assert b_out.outputs[0].finish_reason == "length"  # and not named: one line
