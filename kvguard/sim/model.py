"""A tiny decoder-only transformer with seeded random weights, run over the paged cache.

Pre-norm blocks (RMSNorm, multi-head attention with rotary positions, GELU MLP), fp64
activations. Weights are drawn from a seeded generator — nothing is downloaded — and
scaled so that attention actually matters: the next token depends on the whole prefix,
so KV read from a poisoned or wrong block changes the output.

One :meth:`TinyDecoder.forward` is one engine step: the scheduled tokens of every request
are projected together (a flat batch, like vLLM), and each layer writes every request's
K/V into the cache *before* any request attends — so a request that hit a block another
request writes in the same step reads that step's KV, as on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvguard.sim.config import ModelConfig
from kvguard.sim.kv_cache import PagedKVCache
from kvguard.sim.paged_attention import dense_causal_attention, paged_attention


@dataclass(frozen=True, slots=True)
class ChunkInput:
    """One request's share of a step: tokens at positions ``[start, start + len)``."""

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]
    kv_fault: tuple[int, int] | None = None
    """(layer, position): store NaN K/V there before attention reads it."""
    late_kv_fault: tuple[int, int] | None = None
    """(layer, position): store NaN K/V there after the layer's attention read it."""

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


class TinyDecoder:
    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        d = config.num_heads * config.head_dim
        self.dim = d
        gen = torch.Generator().manual_seed(config.seed)

        def randn(*shape: int, std: float) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, dtype=torch.float64) * std

        self.embed = randn(config.vocab_size, d, std=1.0)
        hidden = d * config.mlp_ratio
        self.layers = [
            {
                "wq": randn(d, d, std=d**-0.5),
                "wk": randn(d, d, std=d**-0.5),
                "wv": randn(d, d, std=d**-0.5),
                "wo": randn(d, d, std=d**-0.5),
                "w1": randn(d, hidden, std=d**-0.5),
                "w2": randn(hidden, d, std=hidden**-0.5),
            }
            for _ in range(config.num_layers)
        ]
        # A larger head scale spreads the logits so greedy picks are far from ties.
        self.lm_head = randn(d, config.vocab_size, std=3.0 * d**-0.5)
        half = config.head_dim // 2
        inv_freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float64) / half))
        angles = torch.arange(config.max_position, dtype=torch.float64)[:, None] * inv_freq
        self._cos = angles.cos()
        self._sin = angles.sin()

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of ``x`` ``[n, heads, head_dim]`` at ``positions``."""
        cos = self._cos[positions][:, None, :]
        sin = self._sin[positions][:, None, :]
        a, b = x.chunk(2, dim=-1)
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6)

    def forward(self, chunks: Sequence[ChunkInput], cache: PagedKVCache) -> torch.Tensor:
        """Run one step; returns the logits of each chunk's last token ``[len(chunks), V]``.

        Writes every chunk's K/V into ``cache`` (layer by layer) as a side effect.
        """
        cfg = self.config
        heads, head_dim = cfg.num_heads, cfg.head_dim
        if any(c.end > cfg.max_position for c in chunks):
            raise ValueError(f"a sequence is longer than max_position={cfg.max_position}")
        tokens = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64)
        positions = torch.cat([torch.arange(c.start, c.end) for c in chunks])
        bounds = [0]
        for c in chunks:
            bounds.append(bounds[-1] + len(c.token_ids))
        new_slots = [cache.slot_index(c.block_table, c.start, c.end) for c in chunks]
        all_slots = [cache.slot_index(c.block_table, 0, c.end) for c in chunks]
        x = self.embed[tokens]
        for layer, w in enumerate(self.layers):
            h = self._norm(x)
            q = self._rope((h @ w["wq"]).view(-1, heads, head_dim), positions)
            k = self._rope((h @ w["wk"]).view(-1, heads, head_dim), positions)
            v = (h @ w["wv"]).view(-1, heads, head_dim)
            for i, c in enumerate(chunks):
                lo, hi = bounds[i], bounds[i + 1]
                ki, vi = k[lo:hi].clone(), v[lo:hi].clone()
                if c.kv_fault is not None and c.kv_fault[0] == layer:
                    ki[c.kv_fault[1] - c.start] = float("nan")
                    vi[c.kv_fault[1] - c.start] = float("nan")
                cache.write(layer, new_slots[i], ki, vi)
            outs = []
            for i, c in enumerate(chunks):
                kc, vc = cache.read(layer, all_slots[i])
                outs.append(paged_attention(q[bounds[i] : bounds[i + 1]], kc, vc, c.start))
            for c in chunks:
                if c.late_kv_fault is not None and c.late_kv_fault[0] == layer:
                    pos = c.late_kv_fault[1]
                    cache.poison(layer, cache.slot_index(c.block_table, pos, pos + 1))
            x = x + torch.cat(outs).reshape(-1, self.dim) @ w["wo"]
            h = self._norm(x)
            x = x + torch.nn.functional.gelu(h @ w["w1"]) @ w["w2"]
        last = torch.tensor(bounds[1:], dtype=torch.int64) - 1
        return self._norm(x[last]) @ self.lm_head

    def reference_generate(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy generation without any cache (full recompute each token): an oracle."""
        cfg = self.config
        tokens = list(prompt)
        for _ in range(max_new_tokens):
            x = self.embed[torch.tensor(tokens)]
            positions = torch.arange(len(tokens))
            for w in self.layers:
                h = self._norm(x)
                q = self._rope((h @ w["wq"]).view(-1, cfg.num_heads, cfg.head_dim), positions)
                k = self._rope((h @ w["wk"]).view(-1, cfg.num_heads, cfg.head_dim), positions)
                v = (h @ w["wv"]).view(-1, cfg.num_heads, cfg.head_dim)
                # Round K/V through the cache dtype, as the paged path stores them.
                k = k.float().double()
                v = v.float().double()
                out = dense_causal_attention(q, k, v)
                x = x + out.reshape(-1, self.dim) @ w["wo"]
                h = self._norm(x)
                x = x + torch.nn.functional.gelu(h @ w["w1"]) @ w["w2"]
            logits = self._norm(x[-1:]) @ self.lm_head
            tokens.append(int(greedy(logits)[0]))
        return tokens[len(prompt) :]


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Argmax per row. A row holding NaN yields the first NaN's index (torch's argmax
    treats NaN as the maximum): a poisoned step emits a deterministic wrong token."""
    return torch.argmax(logits, dim=-1)
