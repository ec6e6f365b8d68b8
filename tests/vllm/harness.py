"""Real vLLM schedulers (0.32 and 0.33) on CPU, driven by hand-built model-runner outputs."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import random
import tempfile
from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest
import torch
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorMetadata,
    MultiKVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.encoder_cache_manager import EncoderDecoderCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvguard.adapters.vllm._compat import runner_output_rows
from kvguard.adapters.vllm.scheduler.guarded import GuardedAsyncScheduler, GuardedScheduler

BLOCK = 16


def worker_kv_cache_configs(vllm_config: Any, specs: Any, available_memory: list[int]) -> Any:
    """The KV cache configs vLLM's EngineCore builds for its workers. (vLLM 0.33 moved
    ``get_kv_cache_configs`` to ``kv_cache_planning`` and has the caller group the
    layers first; 0.32 keeps it in ``kv_cache_utils`` and groups them itself. The
    adapter calls neither: this difference is the tests' own.)"""
    try:
        from vllm.v1.core.kv_cache_planning import (
            get_global_kv_cache_groups,
            get_kv_cache_configs,
        )
    except ImportError:  # vLLM 0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs as configs_032

        return configs_032(vllm_config, specs, available_memory)
    groups = get_global_kv_cache_groups(vllm_config, specs)
    return get_kv_cache_configs(vllm_config, specs, available_memory, groups)


_MODEL_DIR = tempfile.mkdtemp(prefix="kvguard-vllm-model-")
with open(os.path.join(_MODEL_DIR, "config.json"), "w") as f:
    json.dump({"architectures": ["OPTForCausalLM"], "model_type": "opt"}, f)
init_none_hash(sha256)


@functools.cache
def _hasher(block_size: int) -> Any:
    return get_request_block_hasher(block_size, sha256)


_HASHER = _hasher(BLOCK)


def make_vllm_config(
    *,
    async_scheduling: bool = False,
    num_blocks: int = 64,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    kvguard: Mapping[str, Any] | None = None,
    kv_transfer_config: Any = None,
    speculative_config: Any = None,
    prefix_caching: bool = True,
    runner: str = "generate",
    block_size: int = BLOCK,
    encoder_decoder: bool = False,
) -> VllmConfig:
    sched_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=1024,
        enable_chunked_prefill=True,
        async_scheduling=async_scheduling,
        is_encoder_decoder=encoder_decoder,
    )
    model_config = ModelConfig(
        model=_MODEL_DIR,
        skip_tokenizer_init=True,
        dtype="float16",
        seed=42,
        **({"runner": "pooling", "convert": "embed"} if runner == "pooling" else {}),
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    cache_config.num_gpu_blocks = num_blocks
    additional = {"kvguard": dict(kvguard or {"check_invariants": True})}
    return VllmConfig(
        scheduler_config=sched_config,
        model_config=model_config,
        cache_config=cache_config,
        additional_config=additional,
        kv_transfer_config=kv_transfer_config,
        speculative_config=speculative_config,
    )


def make_scheduler(
    *,
    guarded: bool = True,
    async_scheduling: bool = False,
    num_blocks: int = 64,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    kvguard: Mapping[str, Any] | None = None,
    kv_transfer_config: Any = None,
    speculative_config: Any = None,
    prefix_caching: bool = True,
    groups: Sequence[str] = ("full",),
    window: int = 3 * BLOCK,
    runner: str = "generate",
    block_size: int = BLOCK,
    encoder_decoder: bool = False,
    hash_block_size: int | None = None,
    mamba_block_size: int | None = None,
    mamba_cache_mode: str | None = None,
) -> Any:
    """A real scheduler; ``groups`` names its KV cache groups' kinds in order:
    ``"full"`` (full attention), ``"sliding"`` (a ``window``-token sliding window),
    ``"chunked"`` (``window``-token chunked local attention), ``"rswa"`` (R-SWA: the
    prompt and the last ``window`` generated tokens), ``"ring"`` (a circular buffer:
    one block per request, reused in place), ``"sink"`` (full attention with one block
    of static sink tokens), ``"cross"`` (cross-attention: the encoder's KV, with
    ``encoder_decoder=True``), ``"mamba"`` (a Mamba state group: vLLM's ``align``
    mode with prefix caching, ``none`` without) or ``"mamba2"`` (one whose layers
    export a checkpoint of the state inside a prefill chunk, as Mamba2's do).
    ``runner="pooling"``: an embedding model (vLLM's pooling runner), whose outputs
    carry no NaN counts. ``block_size``: other than ``BLOCK``, give
    :func:`make_request` the same. ``hash_block_size``: the
    prefix-match unit (below ``block_size``: partial-block prefix hits on; give
    :func:`make_request` it as its ``block_size``). ``encoder_decoder``: a Whisper-like
    encoder-decoder model (vLLM then chunks no prefill and caches no prefix: pass
    ``prefix_caching=False`` and a ``max_num_batched_tokens`` that holds a prompt),
    whose requests carry an encoder input (:func:`make_request`'s ``encoder_tokens``).
    ``mamba_block_size``: the block size of the ``"mamba"``/``"mamba2"`` groups (default
    ``block_size``); vLLM's own config gives them ``max_model_len`` (1024 here) without
    prefix caching, one state block per request. ``mamba_cache_mode``: vLLM's
    ``CacheConfig.mamba_cache_mode``, which vLLM's config sets for a hybrid model
    (``"align"`` with prefix caching: the scheduler then ends prefill chunks where a
    state is cached, on block boundaries); default: as vLLM sets it, ``"align"`` for a
    model with a Mamba group and prefix caching, else ``CacheConfig``'s own."""
    vllm_config = make_vllm_config(
        async_scheduling=async_scheduling,
        num_blocks=num_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        kvguard=kvguard,
        kv_transfer_config=kv_transfer_config,
        speculative_config=speculative_config,
        prefix_caching=prefix_caching,
        runner=runner,
        block_size=block_size,
        encoder_decoder=encoder_decoder,
    )
    if mamba_cache_mode is None and prefix_caching and {"mamba", "mamba2"} & set(groups):
        mamba_cache_mode = "align"
    if mamba_cache_mode is not None:
        vllm_config.cache_config.mamba_cache_mode = mamba_cache_mode
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                [f"layer{i}"],
                _kv_cache_spec(
                    kind, window, block_size, prefix_caching, mamba_block_size=mamba_block_size
                ),
            )
            for i, kind in enumerate(groups)
        ],
    )
    scheduler_block_size = block_size
    if mamba_block_size and {"mamba", "mamba2"} & set(groups):
        # vLLM schedules (and hashes) in the LCM of the groups' block sizes.
        scheduler_block_size = math.lcm(block_size, mamba_block_size)
    if guarded:
        cls: type = GuardedAsyncScheduler if async_scheduling else GuardedScheduler
    else:
        cls = AsyncScheduler if async_scheduling else Scheduler
    scheduler = cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=scheduler_block_size,
        log_stats=True,
        **({"hash_block_size": hash_block_size} if hash_block_size else {}),
    )
    if encoder_decoder:
        # What vLLM sets up for a model its registry knows as encoder-decoder (the OPT
        # stand-in is not one), as vLLM's own cross-attention scheduler tests do.
        scheduler.is_encoder_decoder = True
        scheduler.max_num_encoder_input_tokens = max_num_batched_tokens
        scheduler.encoder_cache_manager = EncoderDecoderCacheManager(
            cache_size=max_num_batched_tokens
        )
    return scheduler


def tensor_backed_kv_cache_config(spec: Any, num_blocks: int) -> Any:
    """A KV cache config of one group of one layer (``"l0"``, of ``spec``) with its
    tensor described, as the workers report it: SimpleCPU offloading sizes its CPU tier
    from the tensors."""
    page = spec.page_size_bytes
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * num_blocks,
                layers=["l0"],
                layer_stride=page * num_blocks,
                block_stride=page,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
    )


def _kv_cache_spec(
    kind: str,
    window: int,
    block_size: int,
    prefix_caching: bool,
    *,
    mamba_block_size: int | None = None,
) -> Any:
    shape: dict[str, Any] = {
        "block_size": block_size,
        "num_kv_heads": 1,
        "head_size": 1,
        "dtype": torch.float32,
    }
    if kind == "full":
        return FullAttentionSpec(**shape)
    if kind == "sliding":
        return SlidingWindowSpec(**shape, sliding_window=window)
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(**shape, attention_chunk_size=window)
    if kind == "rswa":
        return RSWASpec(**shape, rswa_window=window)
    if kind == "ring":
        return CircularBufferSpec(**shape)
    if kind == "sink":
        return SinkFullAttentionSpec(**shape, sink_len=block_size)
    if kind == "cross":
        return CrossAttentionSpec(**shape)
    if kind in ("mamba", "mamba2"):
        checkpoints = {"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 1}
        return MambaSpec(
            block_size=mamba_block_size or block_size,
            shapes=((1,),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align" if prefix_caching else "none",
            **(checkpoints if kind == "mamba2" else {}),
        )
    raise ValueError(f"unknown KV cache group kind {kind!r}")


def ngram_speculation(num_tokens: int, *, async_scheduling: bool) -> SpeculativeConfig:
    """Speculative decoding with ``num_tokens`` n-gram drafts: vLLM's "ngram" method,
    or under async scheduling its GPU variant "ngram_gpu" (vLLM refuses "ngram" there;
    either builds on CPU, as far as the scheduler goes)."""
    return SpeculativeConfig(
        method="ngram_gpu" if async_scheduling else "ngram",
        num_speculative_tokens=num_tokens,
        prompt_lookup_max=3,
        prompt_lookup_min=2,
    )


def make_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int = 4,
    *,
    block_size: int = BLOCK,
    encoder_tokens: int = 0,
) -> Request:
    """``encoder_tokens``: the length of the request's encoder input (an encoder-decoder
    model's audio, say), which its first step encodes into its cross-attention KV."""
    features = None
    if encoder_tokens:
        features = [
            MultiModalFeatureSpec(
                data=MultiModalKwargsItem.dummy(),
                mm_position=PlaceholderRange(offset=0, length=encoder_tokens),
                identifier=f"{request_id}-encoder-input",
                modality="audio",
            )
        ]
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        mm_features=features,
        block_hasher=_hasher(block_size),
    )


def model_output(
    scheduler: Any, scheduler_output: Any, nans: Mapping[str, int] | None = None, token: int = 5
) -> ModelRunnerOutput:
    """What a worker would return: one sampled token for each request whose step ends
    its prefill or decodes, none for intermediate prefill chunks; NaN counts per request."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    samples = sampling_requests(scheduler, scheduler_output)
    sampled = [[token] if req_id in samples else [] for req_id in req_ids]
    counts = {req_id: 0 for req_id in req_ids}
    counts.update(nans or {})
    return ModelRunnerOutput(
        **runner_output_rows(req_ids),
        sampled_token_ids=sampled,
        num_nans_in_logits=counts,
    )


def sampling_requests(scheduler: Any, scheduler_output: Any) -> set[str]:
    """The requests whose step samples a token: it decodes, or its scheduled tokens
    reach the tokens known when it was scheduled (the end of the prompt, or of the
    prompt and outputs a resumed request recomputes). Read from the scheduler output,
    not from the request now: under async scheduling the next step has moved the
    request's computed tokens on by the time the output is built."""
    scheduled = scheduler_output.num_scheduled_tokens
    out = set()
    for new in scheduler_output.scheduled_new_reqs:
        tokens = (
            new.prefill_token_ids if new.prefill_token_ids is not None else new.prompt_token_ids
        )
        if new.num_computed_tokens + scheduled[new.req_id] >= len(tokens or ()):
            out.add(new.req_id)
    cached = scheduler_output.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        request = scheduler.requests.get(req_id)
        if request is None:
            continue  # gone: vLLM skips its row
        known = request.num_prompt_tokens + cached.num_output_tokens[i]
        if cached.num_computed_tokens[i] + scheduled[req_id] >= known:
            out.add(req_id)
    return out


def step(scheduler: Any, nans: Mapping[str, int] | None = None) -> tuple[Any, dict[int, Any]]:
    """One synchronous schedule -> execute -> update round."""
    so = scheduler.schedule()
    out = scheduler.update_from_output(so, model_output(scheduler, so, nans))
    return so, out


def finish_reasons(outputs: dict[int, Any]) -> dict[str, str]:
    return {
        o.request_id: str(o.finish_reason)
        for eco in outputs.values()
        for o in eco.outputs
        if o.finish_reason is not None
    }


def hit_tokens(scheduler_output: Any) -> dict[str, int]:
    """Prefix-cache hit (num_computed_tokens at admission) of newly scheduled requests."""
    return {n.req_id: n.num_computed_tokens for n in scheduler_output.scheduled_new_reqs}


Arrivals = Mapping[int, tuple[str, list[int], int]]
"""Step -> (request id, prompt, max tokens) of the request added before that step."""


def shared_prefix_arrivals(
    seed: int, requests: int, max_suffix: int, output_tokens: tuple[int, int]
) -> Arrivals:
    """A clean trace's arrivals: one request every 4 steps, each a 2-block prefix
    shared by all plus 1..``max_suffix - 1`` random tokens, its output length drawn
    from ``output_tokens``."""
    rng = random.Random(seed)
    shared = list(range(9000, 9000 + 2 * BLOCK))
    arrivals = {}
    for i in range(requests):
        suffix = [rng.randrange(50_000) for _ in range(rng.randrange(1, max_suffix))]
        arrivals[4 * i] = (f"r{i}", shared + suffix, rng.randrange(*output_tokens))
    return arrivals


def decision_trace(
    scheduler: Any,
    arrivals: Arrivals,
    steps: int,
    *,
    async_scheduling: bool = False,
    nans: Callable[[int, Any], Mapping[str, int]] | None = None,
    worker: Callable[[Any, Any, Mapping[str, int] | None], Any] = model_output,
    after_output: Callable[[Any], None] | None = None,
) -> list[object]:
    """Drive ``scheduler`` through ``steps`` steps (one output in flight under async
    scheduling) and record its decisions: per step, the tokens scheduled (and the draft
    tokens, if any), the prefix hits of new requests and the preempted requests; per
    output, the finish reasons. ``nans(step, scheduler_output)`` gives the NaN counts of
    the output processed at ``step``; ``worker(scheduler, scheduler_output, nans)``
    builds the output (default :func:`model_output`); ``after_output(scheduler)`` runs
    after each (e.g. the engine handing over the next drafts)."""
    trace: list[object] = []
    pending = []
    for t in range(steps):
        if t in arrivals:
            rid, prompt, max_tokens = arrivals[t]
            scheduler.add_request(make_request(rid, prompt, max_tokens))
        so = scheduler.schedule()
        pending.append(so)
        drafts = {r: len(d) for r, d in so.scheduled_spec_decode_tokens.items()}
        hits, preempted = hit_tokens(so), sorted(so.preempted_req_ids)
        trace.append((dict(so.num_scheduled_tokens), drafts, hits, preempted))
        if not async_scheduling or len(pending) == 2:
            done = pending.pop(0)
            counts = nans(t, done) if nans is not None else None
            out = scheduler.update_from_output(done, worker(scheduler, done, counts))
            trace.append(finish_reasons(out))
            if after_output is not None:
                after_output(scheduler)
    return trace


# ---------------------------------------------------------------- KV connectors


def transfer_config(
    connector: str = "GuardedOffloadingConnector",
    load_failure_policy: str = "fail",
    *,
    multi: bool = False,
    cpu_bytes: int = 1 << 20,
) -> KVTransferConfig:
    """The offloading connector's config; ``multi``: inside vLLM's ``MultiConnector``;
    ``cpu_bytes``: the CPU tier's size (the default holds a few hundred chunks)."""
    child = {
        "kv_connector": connector,
        "kv_role": "kv_both",
        "kv_connector_module_path": (
            "kvguard.adapters.vllm" if connector.startswith("Guarded") else None
        ),
        "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes},
    }
    if multi:
        return KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"connectors": [child]},
            kv_load_failure_policy=load_failure_policy,
        )
    return KVTransferConfig(**child, kv_load_failure_policy=load_failure_policy)


def connector_output(
    s: Any,
    so: Any,
    nans: Mapping[str, int] | None = None,
    *,
    completed: Iterable[int] = (),
    recved: Iterable[str] = (),
    invalid: Iterable[int] = (),
    failed: Iterable[int] = (),
) -> Any:
    """The model runner's output, with the workers' report of finished transfer jobs
    (``invalid``: GPU blocks a load failed to fill; ``failed``: jobs of ``completed``
    that failed, which only vLLM 0.34's workers report)."""
    mo = model_output(s, so, nans)
    meta: Any = OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(completed, 1))
    if failed:
        meta.failed_jobs = set(failed)
    if isinstance(s.connector, MultiConnector):
        meta = MultiKVConnectorWorkerMetadata(metadata=(meta,))
    mo.kv_connector_output = KVConnectorOutput(
        finished_recving=set(recved) or None,
        invalid_block_ids=set(invalid),
        kv_connector_worker_meta=meta,
    )
    return mo


def offloading_metadata(so: Any) -> Any:
    """The step's offloading connector metadata (inside a MultiConnector's, if any)."""
    meta = so.kv_connector_metadata
    return meta.metadata[0] if isinstance(meta, MultiKVConnectorMetadata) else meta


@contextlib.contextmanager
def records_of(
    loggers: Sequence[logging.Logger], caplog: pytest.LogCaptureFixture, monkeypatch: Any
) -> Iterator[None]:
    """``caplog`` gets what ``loggers`` log at INFO and above while inside (kvguard's
    loggers sit under vLLM's, which stops propagation: the records are caught at each
    logger)."""
    disabled = logging.root.manager.disable  # (vLLM's suppress_logging can leave it set)
    logging.disable(logging.NOTSET)
    for logger in loggers:
        monkeypatch.setattr(logger, "propagate", False)
        caplog.set_level(logging.INFO, logger=logger.name)
        logger.addHandler(caplog.handler)
    try:
        yield
    finally:
        logging.disable(disabled)
        for logger in loggers:
            logger.removeHandler(caplog.handler)


def lmcache_hit(token_database: Any, token_ids: Any, held: Container[int]) -> int:
    """What LMCache's lookup answers for ``token_ids`` when its store holds the chunk
    hashes ``held``: the tokens of the leading chunks it holds (LMCache's own hashes,
    from its ``token_database``)."""
    hit = 0
    for _, stop, chunk_hash in token_database.process_tokens(list(token_ids), make_key=False):
        if chunk_hash not in held:
            break
        hit = stop
    return hit


class LMCacheLookupStub:
    """LMCache's scheduler-side lookup client without its lookup server (no LMCache
    worker answers here): a subclass answers :meth:`lookup` from what its played
    workers saved."""

    def lookup(self, token_ids: Any, lookup_id: str, request_configs: Any = None) -> int:
        raise NotImplementedError

    def lookup_cache(self, lookup_id: str) -> int:
        return -1  # (no cached answer: LMCache looks up)

    def clear_lookup_status(self, lookup_id: str) -> None:
        pass

    def close(self) -> None:
        pass
