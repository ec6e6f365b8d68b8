"""Causal attention of one request's new tokens over its paged KV cache.

The keys are gathered from the request's block table — only the ``end`` valid slots —
so stale bytes in unused slots are never read. NaN in a slot that *is* read propagates
as in any real kernel: a NaN key makes its score NaN and the softmax row NaN; a NaN value
makes the weighted sum NaN.

Causality inside the step is applied by selection, not by multiplying with zero weights:
``0 * NaN`` is NaN, so a zero-weighted future position would otherwise poison earlier
queries of the same chunk — something a real kernel, which never visits those positions
for those queries, does not do.
"""

from __future__ import annotations

import math

import torch


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Attention output ``[n_q, heads, head_dim]``.

    ``q``: ``[n_q, heads, head_dim]`` for token positions ``[start, start + n_q)``.
    ``k``, ``v``: ``[start + n_q, heads, head_dim]`` for positions ``[0, start + n_q)``,
    read from the cache. Query ``i`` attends to keys ``0 .. start + i``.
    """
    n_q = q.shape[0]
    n_k = k.shape[0]
    if n_k != start + n_q or v.shape[0] != n_k:
        raise ValueError(f"need {start + n_q} keys/values for queries at {start}.., got {n_k}")
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    key_pos = torch.arange(n_k)
    query_pos = torch.arange(start, start + n_q)
    visible = key_pos[None, :] <= query_pos[:, None]  # [n_q, n_k]
    # masked_fill replaces the score itself, so a NaN key a query must not see cannot
    # turn into that query's NaN.
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    # Context keys (before the chunk) are visible to every query: a plain product.
    out = torch.einsum("hqk,khd->qhd", probs[:, :, :start], v[:start])
    if n_q == 1:
        return out + torch.einsum("hqk,khd->qhd", probs[:, :, start:], v[start:])
    # Inside the chunk, select the visible values before the product.
    chunk_visible = visible[:, start:]  # [n_q, n_q]
    picked = torch.where(chunk_visible[:, :, None, None], v[start:][None], 0.0)
    return out + torch.einsum("hqk,qkhd->qhd", probs[:, :, start:], picked)


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal attention over a whole sequence (no paging): the test oracle."""
    n = q.shape[0]
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)
