"""Paged attention against a dense reference, and NaN behaviour of the paged read."""

from __future__ import annotations

import torch

from kvguard.sim.config import ModelConfig
from kvguard.sim.kv_cache import PagedKVCache
from kvguard.sim.model import ChunkInput, TinyDecoder, greedy
from kvguard.sim.paged_attention import dense_causal_attention, paged_attention


def _scatter(cache: PagedKVCache, table: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
    cache.write(0, cache.slot_index(table, 0, k.shape[0]), k, v)


def test_paged_matches_dense_for_every_chunk_split() -> None:
    gen = torch.Generator().manual_seed(0)
    n, heads, dim = 19, 2, 16  # odd length: the last block is partial
    q, k, v = (torch.randn(n, heads, dim, generator=gen, dtype=torch.float64) for _ in range(3))
    k, v = k.float().double(), v.float().double()  # what the fp32 cache returns
    cache = PagedKVCache(1, 12, 4, heads, dim)
    table = [7, 2, 11, 0, 5]  # scattered, out of order
    _scatter(cache, table, k, v)
    expected = dense_causal_attention(q, k, v)
    for start in (0, 1, 4, 9, 18):
        kc, vc = cache.read(0, cache.slot_index(table, 0, n))
        got = paged_attention(q[start:], kc, vc, start)
        torch.testing.assert_close(got, expected[start:], rtol=1e-12, atol=1e-12)


def test_unused_slots_are_never_read() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(6, 2, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    cache = PagedKVCache(1, 4, 4, 2, 16)
    cache.caches[0].fill_(float("nan"))  # stale garbage everywhere
    _scatter(cache, [3, 1], k, v)  # 6 tokens: slots 2..3 of block 1 stay NaN
    kc, vc = cache.read(0, cache.slot_index([3, 1], 0, 6))
    assert torch.isfinite(paged_attention(q, kc, vc, 0)).all()


def test_nan_in_a_read_slot_poisons_later_queries_only() -> None:
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(8, 2, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    v[5] = float("nan")
    out = paged_attention(q, k, v, 0)
    # Queries before position 5 never see it (selection, not zero weights times NaN).
    assert torch.isfinite(out[:5]).all()
    assert torch.isnan(out[5:]).all()


def test_engine_forward_over_chunks_matches_full_recompute() -> None:
    """The model over a paged cache, prefilled in chunks then decoded, generates exactly
    what a cache-free full recompute generates."""
    cfg = ModelConfig()
    model = TinyDecoder(cfg)
    prompt = [3, 17, 42, 5, 9, 60, 1, 33, 8, 21, 13]
    expected = model.reference_generate(prompt, 6)
    cache = PagedKVCache(cfg.num_layers, 16, 4, cfg.num_heads, cfg.head_dim)
    table = [9, 4, 14, 0, 11]
    tokens = list(prompt)
    # Prefill in two chunks, batched with an unrelated request to share the step.
    other = ChunkInput([1, 2, 3], 0, [15])
    model.forward([ChunkInput(tokens[:5], 0, table), other], cache)
    logits = model.forward([ChunkInput(tokens[5:], 5, table)], cache)
    for _ in range(6):
        tokens.append(int(greedy(logits)[0]))
        pos = len(tokens) - 1
        if len(tokens) - len(prompt) == 6:
            break
        logits = model.forward([ChunkInput(tokens[pos:], pos, table)], cache)
    assert tokens[len(prompt) :] == expected


def test_kv_fault_poisons_the_step_and_stays_in_the_cache() -> None:
    cfg = ModelConfig()
    model = TinyDecoder(cfg)
    cache = PagedKVCache(cfg.num_layers, 8, 4, cfg.num_heads, cfg.head_dim)
    clean = ChunkInput([1, 2, 3, 4, 5, 6], 0, [0, 1])
    faulty = ChunkInput([1, 2, 3, 4, 5, 6], 0, [2, 3], kv_fault=(1, 2))
    logits = model.forward([clean, faulty], cache)
    assert torch.isfinite(logits[0]).all()  # the neighbour in the batch is untouched
    assert torch.isnan(logits[1]).all()
    assert not torch.isfinite(cache.caches[1][2]).all()


def test_late_kv_fault_leaves_logits_finite() -> None:
    cfg = ModelConfig()
    model = TinyDecoder(cfg)
    cache = PagedKVCache(cfg.num_layers, 8, 4, cfg.num_heads, cfg.head_dim)
    chunk = ChunkInput([1, 2, 3, 4, 5], 0, [0, 1], late_kv_fault=(0, 3))
    logits = model.forward([chunk], cache)
    assert torch.isfinite(logits).all()
    assert torch.isnan(cache.caches[0][0, :, 3]).all()
