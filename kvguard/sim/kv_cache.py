"""The paged KV cache: one fp32 tensor per layer in FlashInfer layout.

Shape per layer ``[num_blocks, 2, block_size, heads, head_dim]`` (K at index 0, V at 1 of
dim 1). Block ids are the ones :class:`kvguard.BlockPool` hands out, and the same tensors
are described to ``kvguard.kernels`` (zeroing, audit) through :attr:`layout`.

The model computes in fp64 but stores K/V in fp32: every reader — the request that wrote
the KV and any request that hits it later — sees the same rounded values, so a cache hit
reproduces a recomputation exactly (ground truth comparisons stay honest).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvguard.kernels import KVCacheLayout, LayoutKind

CACHE_DTYPE = torch.float32


class PagedKVCache:
    def __init__(
        self, num_layers: int, num_blocks: int, block_size: int, num_heads: int, head_dim: int
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caches = [
            torch.zeros(num_blocks, 2, block_size, num_heads, head_dim, dtype=CACHE_DTYPE)
            for _ in range(num_layers)
        ]
        self.layout = KVCacheLayout(self.caches, LayoutKind.FLASHINFER, block_size=block_size)

    def slot_index(
        self, block_table: Sequence[int], start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids, offsets) of token positions ``[start, end)`` of one request."""
        size = self.block_size
        positions = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.int64)
        return table[positions // size], positions % size

    def write(
        self, layer: int, slots: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store ``k``/``v`` ``[n, heads, head_dim]`` at ``slots`` of ``layer``."""
        blocks, offsets = slots
        cache = self.caches[layer]
        cache[blocks, 0, offsets] = k.to(CACHE_DTYPE)
        cache[blocks, 1, offsets] = v.to(CACHE_DTYPE)

    def read(
        self, layer: int, slots: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[n, heads, head_dim]`` (fp64) at ``slots`` of ``layer``.

        Only the slots asked for are read: unused slots of a partial block, whatever
        they hold, never reach attention (as a varlen kernel masks its loads).
        """
        blocks, offsets = slots
        cache = self.caches[layer]
        return (
            cache[blocks, 0, offsets].to(torch.float64),
            cache[blocks, 1, offsets].to(torch.float64),
        )

    def poison(self, layer: int | None, slots: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Write NaN into K and V at ``slots`` (of one layer, or all when ``None``)."""
        blocks, offsets = slots
        layers = range(self.num_layers) if layer is None else (layer,)
        for i in layers:
            self.caches[i][blocks, :, offsets] = float("nan")

    def block_data(self, block_id: int) -> torch.Tensor:
        """A copy of one block in every layer: ``[layers, 2, block_size, heads, head_dim]``."""
        return torch.stack([cache[block_id] for cache in self.caches]).clone()

    def load_block(self, block_id: int, data: torch.Tensor) -> None:
        """Overwrite one block in every layer with ``data`` from :meth:`block_data`."""
        for cache, layer_data in zip(self.caches, data, strict=True):
            cache[block_id] = layer_data
