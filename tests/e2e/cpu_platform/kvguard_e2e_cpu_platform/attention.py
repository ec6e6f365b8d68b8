"""Paged attention over vLLM's CPU KV cache (``vllm/v1/attention/backends/cpu_attn.py``).

The cache layout is the CPU backend's: per layer ``[num_blocks, num_kv_heads,
block_size, 2 * head_size]``, viewed by the backend as a key cache and a value cache of
``[num_blocks, num_kv_heads, block_size, head_size]`` each. Slot ``s`` is offset
``s % block_size`` of block ``s // block_size``.

Supported: causal (per request with ``dynamic_causal``) and bidirectional attention,
GQA, logit soft-capping and sliding windows, in the model's dtype (computed in fp32).
ALiBi, attention sinks and fp8 KV caches raise NotImplementedError.
"""

from __future__ import annotations

import torch

from .library import op


def _unsupported(kv_cache_dtype: str) -> None:
    if kv_cache_dtype != "auto":
        raise NotImplementedError(
            f"kvguard_e2e_cpu_platform: kv_cache_dtype={kv_cache_dtype!r} (fp8 KV cache)"
        )


@op(
    "get_scheduler_metadata(int num_req, int num_heads_q, int num_heads_kv, "
    "int head_dim, Tensor seq_lens, ScalarType dtype, Tensor "
    "query_start_loc, bool casual, int window_size, str isa_hint, bool "
    "enable_kv_split, Tensor? dynamic_causal, "
    'str kv_cache_dtype="auto") -> Tensor'
)
def get_scheduler_metadata(
    num_req: int,
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    seq_lens: torch.Tensor,
    dtype: torch.dtype,
    query_start_loc: torch.Tensor,
    casual: bool,
    window_size: int,
    isa_hint: str,
    enable_kv_split: bool,
    dynamic_causal: torch.Tensor | None,
    kv_cache_dtype: str = "auto",
) -> torch.Tensor:
    """An empty plan: vLLM's kernel splits the work among its threads here; this
    attention walks the requests one by one and needs none."""
    _unsupported(kv_cache_dtype)
    return torch.empty(0, dtype=torch.uint8)


@op(
    "cpu_attn_reshape_and_cache(Tensor key, Tensor value, Tensor(a2!) "
    "key_cache, Tensor(a3!) value_cache, Tensor slot_mapping, str isa, "
    'float k_scale=1.0, float v_scale=1.0, str kv_cache_dtype="auto") -> '
    "()"
)
def cpu_attn_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    isa: str,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_cache_dtype: str = "auto",
) -> None:
    """Write token ``i``'s key and value ``[num_kv_heads, head_size]`` to slot
    ``slot_mapping[i]``; a negative slot (padding) is skipped, as in vLLM's kernel."""
    _unsupported(kv_cache_dtype)
    slots = slot_mapping[: key.size(0)]
    kept = slots >= 0
    slots = slots[kept]
    block_size = key_cache.size(2)
    blocks, offsets = slots // block_size, slots % block_size
    # (Advanced indices around a slice: the indexed shape is [tokens, heads, head_size].)
    key_cache[blocks, :, offsets] = key[kept].to(key_cache.dtype)
    value_cache[blocks, :, offsets] = value[kept].to(value_cache.dtype)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int, group: int) -> torch.Tensor:
    """A request's first ``seq_len`` cached tokens, in fp32: ``[blocks, kv_heads, block,
    d]`` -> ``[heads, seq_len, d]``, each KV head repeated for the ``group`` query heads
    that share it."""
    tokens = cache[blocks].transpose(0, 1).reshape(cache.size(1), -1, cache.size(3))
    return tokens[:, :seq_len].float().repeat_interleave(group, dim=0)


@op(
    "cpu_attention_with_kv_cache(Tensor query, Tensor key_cache, Tensor "
    "value_cache, Tensor(a3!) output, Tensor query_start_loc, Tensor "
    "seq_lens, float scale, bool causal, Tensor? alibi_slopes, SymInt "
    "sliding_window_size, Tensor block_table, "
    "float softcap, Tensor scheduler_metadata, Tensor? s_aux, Tensor? "
    "dynamic_causal, "
    'float k_scale=1.0, float v_scale=1.0, str kv_cache_dtype="auto") -> '
    "()"
)
def cpu_attention_with_kv_cache(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    causal: bool,
    alibi_slopes: torch.Tensor | None,
    sliding_window_size: int,
    block_table: torch.Tensor,
    softcap: float,
    scheduler_metadata: torch.Tensor,
    s_aux: torch.Tensor | None,
    dynamic_causal: torch.Tensor | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_cache_dtype: str = "auto",
) -> None:
    """``output[t] = attention(query[t])`` for each request's query tokens.

    Request ``r`` has the query tokens ``query_start_loc[r] : query_start_loc[r + 1]``,
    the last ones of its ``seq_lens[r]`` tokens, whose keys and values are in the cache
    already (the backend writes this step's first), in the blocks ``block_table[r]``.
    Query token ``i`` of ``n`` sits at position ``seq_len - n + i``; causal, it sees
    the keys at positions up to its own; a window of ``w`` (``-1``: none) keeps the
    last ``w`` of them (and, bidirectional, the next ``w - 1``)."""
    _unsupported(kv_cache_dtype)
    if alibi_slopes is not None or s_aux is not None:
        raise NotImplementedError("kvguard_e2e_cpu_platform: ALiBi or attention sinks")
    block_size = key_cache.size(2)
    group = query.size(1) // key_cache.size(1)  # query heads per KV head (GQA)
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    causal_of = dynamic_causal.tolist() if dynamic_causal is not None else None
    # (Padded batches carry requests with no query tokens: skipped.)
    for r in range(min(len(starts) - 1, len(lengths))):
        start, end, seq_len = starts[r], starts[r + 1], lengths[r]
        if end == start:
            continue
        blocks = block_table[r, : -(-seq_len // block_size)].long()
        keys = _gather(key_cache, blocks, seq_len, group)
        values = _gather(value_cache, blocks, seq_len, group)
        q = query[start:end].float()  # [n, heads, d]
        logits = torch.einsum("nhd,hsd->hns", q, keys) * scale
        if softcap != 0:
            logits = softcap * torch.tanh(logits / softcap)
        q_pos = torch.arange(seq_len - (end - start), seq_len).unsqueeze(1)
        kv_pos = torch.arange(seq_len).unsqueeze(0)
        is_causal = bool(causal_of[r]) if causal_of is not None else causal
        visible = torch.ones(end - start, seq_len, dtype=torch.bool)
        if is_causal:
            visible &= kv_pos <= q_pos
        if sliding_window_size > 0:
            visible &= kv_pos > q_pos - sliding_window_size
            if not is_causal:
                visible &= kv_pos < q_pos + sliding_window_size
        probs = logits.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out = torch.einsum("hns,hsd->nhd", probs, values)
        output[start:end] = out.to(output.dtype)
