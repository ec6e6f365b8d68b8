"""A CPU offload tier: block copies keyed by block hash, LRU-evicted.

The engine chooses what to store through the pool's tier gate (``storable_blocks`` /
``begin_store``) and registers a copy only if ``ack_store`` accepts it; a copy whose
block was quarantined, invalidated or reused while in flight is dropped. Each entry
remembers whether its bytes came from a step that failed (ground truth, for the report).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvguard.hashing import BlockHash

TIER = "cpu"


@dataclass(frozen=True, slots=True)
class TierEntry:
    data: torch.Tensor
    """``[layers, 2, block_size, heads, head_dim]``, as :meth:`PagedKVCache.block_data`."""
    from_failed_step: bool
    """Written (in part) by a step that failed validation, or holding non-finite KV."""
    seal: int | None = None
    """The seal of the block's validated KV (:attr:`StoreTicket.seal`), if it had one."""
    rotten: bool = False
    """A tier-rot fault altered the copy after it was stored (ground truth)."""


class CpuTier:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._entries: OrderedDict[BlockHash, TierEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    def put(self, block_hash: BlockHash, entry: TierEntry) -> list[BlockHash]:
        """Store an entry; returns the hashes evicted to make room (LRU first)."""
        evicted: list[BlockHash] = []
        self._entries[block_hash] = entry
        self._entries.move_to_end(block_hash)
        while len(self._entries) > self.capacity:
            old, _ = self._entries.popitem(last=False)
            evicted.append(old)
        return evicted

    def remove(self, block_hash: BlockHash) -> None:
        """Drop an entry (a load refused it)."""
        self._entries.pop(block_hash, None)

    def get(self, block_hash: BlockHash) -> TierEntry:
        """The entry for a hit (and mark it recently used)."""
        self._entries.move_to_end(block_hash)
        return self._entries[block_hash]
