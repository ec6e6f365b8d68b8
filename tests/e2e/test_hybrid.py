"""Hybrid models (recurrent layers beside attention) with prefix caching in a real engine:
a NaN in one request's prefill poisons its recurrent state, and every prefix-cache
checkpoint of that state taken after the fault.

vLLM runs a hybrid's recurrent layers as a Mamba KV cache group beside the attention
group, with prefix caching in ``mamba_cache_mode="align"``: each prefill chunk ends at a
block boundary (or the prompt's end), the state after a block is a checkpoint in a block
of its own, published under the block's hash like the attention KV, and a prefix hit
resumes from the checkpoint where it ends (a request's running state is a copy of it).
The engines here keep every block's checkpoint (``prefix_cache_retention_interval=None``),
so the hit length shows which checkpoints were published.

Three cases (:data:`CASES`), each run on stock vLLM and with kvguard's guard on:

* ``gdn``: Qwen3-Next (gated-delta-net + attention), bf16, 96-token blocks;
* ``gdn-partial``: the same with ``prefix_match_unit=32``: prefix hits end on any
  32-token boundary, inside a block (a request's prompt-tail checkpoint);
* ``mamba2``: GraniteMoeHybrid (Mamba2 + attention), fp32, 32-token blocks.

In each, request A's prompt carries a NaN trigger past its first block; B, sharing A's
prompt beyond the fault, runs after A; then A again (the fault was transient). Stock
vLLM publishes A's checkpoints taken after the fault, and B and the retry resume from
NaN state. Guarded, A ends with an error alone, no block holding its poisoned state is
published, and B and the retry resume from the last checkpoint before the fault (or a
later one B computed cleanly), producing the fault-free output.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from .conftest import HAVE_ENGINE, SKIP_REASON

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not HAVE_ENGINE, reason=SKIP_REASON)]

if HAVE_ENGINE:
    from .conftest import guard_in_this_process, in_process, kvguard_log, shutdown
    from .engine import (
        GDN_ENGINE_KWARGS,
        MAMBA2_ENGINE_KWARGS,
        HybridBlock,
        Result,
        blocks_in_state,
        build_gdn_model,
        build_mamba2_model,
        faults_fired,
        generate,
        hybrid_layout,
        matchable_blocks,
        non_finite_blocks,
        read_hybrid_blocks,
        scheduler,
        set_faults,
        tokens,
        trigger,
        watch_group_steps,
        watch_zeroing,
        with_token,
        zeroing_seen,
    )


@dataclass(frozen=True)
class Case:
    """One hybrid engine and the trace run on it. Positions are token positions."""

    model: str
    """``"gdn"`` or ``"mamba2"``: which tiny model (and reference engine)."""
    kwargs: dict[str, Any]
    """``LLM(**kwargs)``."""
    block: int
    """The block size vLLM runs both groups with."""
    prompt: int
    """A's prompt length."""
    fault: int
    """Where A's prompt carries ``trigger(0)``: its row, and all after, go NaN."""
    failing_step: tuple[int, int]
    """The positions (first, last) of the prefill step that computes the fault."""
    shared: int
    """B's prompt: A's first ``shared`` tokens, then 20 of its own."""
    stock_hit: int
    """Tokens B and the retry hit on stock vLLM: A's last checkpoint B's prompt
    reaches, taken after the fault."""
    retry_hit: int
    """Tokens the retry hits when guarded: a checkpoint B computed cleanly where it
    shares A's prompt, or A's validated prefix."""

    @property
    def validated(self) -> int:
        """A's checkpoints before the step that failed: the block boundary before it."""
        return self.failing_step[0] // self.block * self.block


CASES: dict[str, Case] = {}
if HAVE_ENGINE:
    CASES = {
        # Chunks (64 tokens, cut where a 96-token block ends): 0-63, 64-95, 96-159,
        # 160-191, 192-255, 256-287, 288-299. Checkpoints at 96, 192, 288.
        "gdn": Case(
            "gdn",
            GDN_ENGINE_KWARGS,
            block=96,
            prompt=300,
            fault=200,
            failing_step=(192, 255),
            shared=288,
            stock_hit=288,
            retry_hit=288,  # B's own checkpoint at 288, computed from 192 on
        ),
        # Chunks: ... 160-191, 192-223 (cut at the prompt's last 32-token boundary:
        # A's tail checkpoint at 224, inside block 2), 224-249.
        "gdn-partial": Case(
            "gdn",
            {**GDN_ENGINE_KWARGS, "prefix_match_unit": 32},
            block=96,
            prompt=250,
            fault=200,
            failing_step=(192, 223),
            shared=240,
            stock_hit=224,
            # B's checkpoints past 192 are at its own prompt's boundaries (its tail:
            # 256); none at 224, where the retry's prompt would need one.
            retry_hit=192,
        ),
        # Chunks of one 32-token block each; checkpoints at every 32.
        "mamba2": Case(
            "mamba2",
            MAMBA2_ENGINE_KWARGS,
            block=32,
            prompt=150,
            fault=70,
            failing_step=(64, 95),
            shared=128,
            stock_hit=128,
            retry_hit=128,  # B's own checkpoint at 128, computed from 64 on
        ),
    }


def prompts(case: Case, seed: int) -> tuple[list[int], list[int]]:
    """(A, B) of ``case``: A with its trigger, B sharing A's first ``case.shared``."""
    a = with_token(tokens(seed, case.prompt), case.fault, trigger(0))
    return a, a[: case.shared] + tokens(seed + 1, 20)


def held(table: list[list[int]]) -> list[list[int]]:
    """A request's per-group block ids without vLLM's null block (0: the Mamba group's
    table holds it where no state is kept, and before a prefix hit's checkpoint)."""
    return [[b for b in group if b] for group in table]


# ---------------------------------------------------------------- engines


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return CASES[request.param]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {
        "gdn": build_gdn_model(str(tmp_path_factory.mktemp("nan-qwen3-next"))),
        "mamba2": build_mamba2_model(str(tmp_path_factory.mktemp("nan-granite"))),
    }


@pytest.fixture(scope="module")
def references() -> Iterator[dict[str, Any]]:
    """The reference engine of each model, built on first use, shared by its cases."""
    built: dict[str, Any] = {}
    yield built
    for llm in built.values():
        shutdown(llm)


@pytest.fixture(scope="module")
def reference(case: Case, model_dirs: dict[str, str], references: dict[str, Any]) -> Any:
    """A stock in-process engine with the model's faults off (one per model; the
    fault-free output does not depend on the prefix-hit granularity)."""
    from vllm import LLM

    if case.model not in references:
        with in_process():
            llm = LLM(model=model_dirs[case.model], **case.kwargs)
        set_faults(llm, False)
        references[case.model] = llm
    return references[case.model]


@pytest.fixture(scope="module")
def stock(case: Case, model_dirs: dict[str, str], reference: Any) -> Iterator[Any]:
    """Stock vLLM: its own scheduler and pool, no kvguard plugin in force."""
    from vllm import LLM

    with in_process():
        llm = LLM(model=model_dirs[case.model], **case.kwargs)
    assert type(scheduler(llm)).__name__ == "Scheduler"
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def guarded(case: Case, model_dirs: dict[str, str], stock: Any) -> Iterator[Any]:
    """The same engine with kvguard's plugin in force (``KVGUARD_GUARD=1``). Built after
    (and torn down with) the case's stock engine, so no stock engine is built while
    the plugin's patches are applied."""
    from vllm import LLM

    with guard_in_this_process():
        with in_process():
            llm = LLM(model=model_dirs[case.model], **case.kwargs)
        sched = scheduler(llm)
        assert type(sched).__name__ == "GuardedScheduler"
        assert sched.kvguard_pool.core is not None
        yield llm
        shutdown(llm)


# ---------------------------------------------------------------- vLLM's hybrid


def test_vllm_runs_the_test_models_as_hybrids(case: Case, stock: Any) -> None:
    """The fault-injecting subclasses, chosen by ``hf_overrides``, are hybrids to vLLM:
    a Mamba group and an attention group of one block size, prefix caching in align
    mode, one checkpoint kept per block; partial-block hits only where asked for."""
    core = stock.llm_engine.engine_core.engine_core
    config = core.vllm_config
    assert config.model_config.is_hybrid
    assert config.model_config.architecture == case.kwargs["hf_overrides"]["architectures"][0]
    assert config.cache_config.mamba_cache_mode == "align"
    assert config.cache_config.prefix_cache_retention_interval is None
    coordinator = core.scheduler.kv_cache_manager.coordinator
    groups = [(type(m).__name__, m.block_size) for m in coordinator.single_type_managers]
    assert groups == [("MambaManager", case.block), ("FullAttentionManager", case.block)]
    partial = "prefix_match_unit" in case.kwargs
    assert coordinator.enable_partial_hash_hits == partial
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.hash_block_size == (32 if partial else case.block)


def test_one_tensor_holds_both_groups_and_zeroing_covers_the_state(case: Case, stock: Any) -> None:
    """vLLM's hybrid cache: the two groups' tensors are views of one allocation with one
    page per block id; a block id belongs to one group at a time, and block ``b``'s
    recurrent state is the first bytes of block ``b``'s attention page. vLLM's CPU
    zeroer zeroes a block through the attention layers' tensors (the whole page), so it
    clears the state a Mamba-group block held too. Stock vLLM asks for the attention
    group's new blocks to be zeroed, not the Mamba group's."""
    layout = hybrid_layout(stock)
    assert (layout.state_tensors, layout.kv_tensors) == (2, 1)  # conv + SSM state; KV
    assert layout.one_storage and layout.same_block_stride and layout.state_inside_kv_page
    assert 0 < layout.state_bytes <= layout.block_stride

    log = watch_group_steps(stock)
    (out,) = generate(stock, [tokens(900, 3 * case.block)], max_tokens=2)
    assert out.finish_reason == "length"
    ((mamba, attention),) = [held(t) for t in log.blocks.values()]
    zeroed = {b for step in log.zeroed for b in step}
    assert set(attention) <= zeroed and not set(mamba) & zeroed
    written = read_hybrid_blocks(stock, mamba)
    assert all(b.state_non_zero for b in written.values())  # its checkpoints

    # The worker's own zeroer on one of those checkpoint blocks: its state is gone.
    (block, *_) = mamba
    stock.collective_rpc(_zero_blocks, args=([block],))
    assert read_hybrid_blocks(stock, [block])[block] == HybridBlock(0, 0, 0, 0)
    stock.reset_prefix_cache()  # the zeroed checkpoint is no prefix for a later test


def _zero_blocks(worker: Any, block_ids: list[int]) -> None:
    worker.model_runner._zero_block_ids(block_ids)


# ---------------------------------------------------------------- stock


def test_stock_vllm_serves_the_poisoned_state(case: Case, reference: Any, stock: Any) -> None:
    """Stock: A delivers tokens sampled from NaN logits; its checkpoints taken after
    the fault are published, and B and the retry resume from them (a hit past the
    fault) and deliver garbage from NaN logits."""
    a, b = prompts(case, 1)
    ref_a, ref_b = generate(reference, [a, b])
    log = watch_group_steps(stock)
    (a_out,) = generate(stock, [a])
    assert (case.fault, trigger(0)) in faults_fired(stock)
    assert a_out.finish_reason == "length"
    assert a_out.token_ids != ref_a.token_ids
    poisoned = matchable_blocks(stock) & non_finite_blocks(stock)
    assert poisoned, "A's checkpoints / KV after the fault are published"
    state = read_hybrid_blocks(stock, poisoned)
    assert any(s.state_non_finite for s in state.values())  # a NaN state checkpoint

    (b_out,) = generate(stock, [b])
    # The first state block B holds: the checkpoint of its hit (for a hit inside a
    # block, vLLM's copy of it), B's state carried on from there.
    resumed = held(list(log.blocks.values())[-1])[0][0]
    assert read_hybrid_blocks(stock, [resumed])[resumed].state_non_finite
    (retry,) = generate(stock, [a])
    assert b_out.num_cached_tokens == case.stock_hit > case.fault
    assert b_out.token_ids != ref_b.token_ids
    assert retry.num_cached_tokens == case.stock_hit
    assert retry.token_ids != ref_a.token_ids
    a_id, b_id, retry_id = log.blocks
    assert all(log.nans.get(r, 0) > 0 for r in (a_id, b_id, retry_id)), log.nans


# ---------------------------------------------------------------- guarded


def test_guarded_aborts_a_alone_and_publishes_only_the_validated_prefix(
    case: Case, reference: Any, guarded: Any
) -> None:
    """Guarded: A ends with "error" and delivers nothing (the step computing its fault
    is named); no block holding its poisoned state or KV is published; B hits exactly
    A's validated prefix (the block boundary before the failing step) and produces the
    fault-free output; the retry too, hitting B's clean checkpoints where B shares
    A's prompt."""
    a, b = prompts(case, 1)
    ref_a, ref_b = generate(reference, [a, b])
    aborted_before = scheduler(guarded).kvguard_stats()["requests_aborted"]
    with kvguard_log() as records:
        (a_out,) = generate(guarded, [a])
    assert (case.fault, trigger(0)) in faults_fired(guarded)
    assert (a_out.token_ids, a_out.finish_reason) == ((), "error")
    (abort,) = records
    first, last = case.failing_step
    assert re.fullmatch(
        rf"kvguard: aborted request \S+ \(finish reason 'error'\): the step computing its "
        rf"positions {first}\.\.{last} \(prompt {case.prompt} tokens, 0 output token\(s\)\) "
        r"had \d+ NaN logit\(s\); .*",
        abort.getMessage(),
    ), abort.getMessage()

    nan_blocks = non_finite_blocks(guarded)
    assert nan_blocks, "A's poisoned state and KV are in the cache"
    assert nan_blocks <= blocks_in_state(guarded, "QUARANTINED")
    assert not matchable_blocks(guarded) & nan_blocks
    state = read_hybrid_blocks(guarded, nan_blocks)
    assert any(s.state_non_finite for s in state.values())  # the NaN state, held back

    (b_out,) = generate(guarded, [b])
    assert b_out == Result(ref_b.token_ids, "length", case.validated)
    (retry,) = generate(guarded, [a])
    assert retry == Result(ref_a.token_ids, "length", case.retry_hit)
    assert not matchable_blocks(guarded) & non_finite_blocks(guarded)
    assert scheduler(guarded).kvguard_stats()["requests_aborted"] == aborted_before + 1


def test_guarded_quarantined_state_blocks_are_zeroed_before_reuse(
    case: Case, reference: Any, guarded: Any
) -> None:
    """Read the worker's caches. A's failing step leaves NaN in its running state block
    (Mamba group) and in its attention block; both are quarantined. R, a fresh prompt,
    is then handed blocks, quarantined ones among them, and one as its own Mamba-group
    state block: the scheduler tells the worker to zero each quarantined block before
    the step that hands it out; the worker's zeroer leaves it all zero, read through the
    recurrent layers' state tensors and through the attention KV, before the forward
    writes it; after R no block it was handed holds NaN."""
    # The model fires a fault once per (position, trigger token): A's trigger is
    # another token than the first test's, one position earlier, for the same fault.
    a = with_token(tokens(30, case.prompt), case.fault - 1, trigger(1))
    r = tokens(40, 2 * case.block + 10)
    (ref_r,) = generate(reference, [r], max_tokens=4)
    log = watch_group_steps(guarded)
    (a_out,) = generate(guarded, [a])
    assert a_out.finish_reason == "error"
    ((a_mamba, a_attention),) = [held(t) for t in log.blocks.values()]
    state_block, kv_block = a_mamba[-1], a_attention[-1]  # the failing step's
    # Of A's blocks, the failing step's (what other tests left quarantined aside).
    quarantined = blocks_in_state(guarded, "QUARANTINED") & set(a_mamba + a_attention)
    assert quarantined == {state_block, kv_block}
    before = read_hybrid_blocks(guarded, quarantined)
    assert before[state_block].state_non_finite and before[kv_block].kv_non_finite, before

    log = watch_group_steps(guarded)
    watch_zeroing(guarded)
    (r_out,) = generate(guarded, [r], max_tokens=4)
    assert r_out == Result(ref_r.token_ids, "length", 0)
    ((mamba, attention),) = [held(t) for t in log.blocks.values()]
    reused = quarantined & set(mamba + attention)
    assert reused & set(mamba), (quarantined, mamba, attention)  # a state block
    for block in reused:
        step = log.handed_at[block]
        assert any(block in sent for sent in log.zeroed[: step + 1]), (block, log.zeroed)
    # In the worker, right after zeroing (before the forward): nothing left in the
    # state view either (the zeroer clears the whole page through the attention KV).
    zeroed_now = {b: kv for call in zeroing_seen(guarded) for b, kv in call.items()}
    assert reused <= set(zeroed_now)
    assert all(zeroed_now[b] == HybridBlock(0, 0, 0, 0) for b in reused), zeroed_now
    after = read_hybrid_blocks(guarded, reused)
    assert all(kv.state_non_finite == kv.kv_non_finite == 0 for kv in after.values()), after
    assert not matchable_blocks(guarded) & non_finite_blocks(guarded)
