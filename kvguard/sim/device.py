"""The simulator's one door to ``kvguard.kernels``: wipe, count, audit, seal.

Everything the engine does to cache bytes on the pool's behalf goes through here, on the
kernels' pure-torch reference path (the cache lives on the CPU; the Triton interpreter
would only make the simulation slower, and the kernels are tested on their own).
Returns byte counts so the report shows what each policy wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from kvguard.kernels import (
    CacheWiper,
    NonFiniteMode,
    audit_blocks,
    count_nonfinite_per_request,
    seal_blocks,
)
from kvguard.kernels.wiper import TailWipe
from kvguard.pool import BlockPool
from kvguard.sim.kv_cache import PagedKVCache

BACKEND: Literal["torch"] = "torch"


class DeviceOps:
    def __init__(self, pool: BlockPool, cache: PagedKVCache) -> None:
        self.layout = cache.layout
        self.wiper = CacheWiper(pool, cache.layout, backend=BACKEND)

    def flush_zeroing(self) -> tuple[tuple[int, ...], int]:
        """Zero what the pool queued; returns (whole blocks zeroed, bytes written)."""
        result = self.wiper.flush()
        layout = self.layout
        written = (
            len(result.block_ids) * layout.bytes_per_block
            + result.num_slots * layout.bytes_per_slot
        )
        return result.block_ids, written

    def zero_request_tail(self, request_id: str) -> tuple[TailWipe, int]:
        """Roll the request back to its validated boundary and wipe its tail."""
        wipe = self.wiper.zero_request_tail(request_id)
        return wipe, wipe.num_slots_wiped * self.layout.bytes_per_slot

    @staticmethod
    def count_nonfinite(logits: torch.Tensor) -> list[int]:
        """NaN count of each row's request (one row per request in this engine)."""
        cu_rows = torch.arange(logits.shape[0] + 1, dtype=torch.int64)
        # The kernels take fp32/fp16/bf16 logits; fp32 keeps every NaN a NaN.
        counts = count_nonfinite_per_request(
            logits.float(), cu_rows, NonFiniteMode.NAN, backend=BACKEND
        )
        return [int(c) for c in counts]

    def seal(self, block_ids: Sequence[int]) -> list[int]:
        """Per block: its seal over every layer (:func:`kvguard.kernels.seal_blocks`)."""
        return [int(s) for s in seal_blocks(self.layout, list(block_ids), backend=BACKEND)]

    def audit(self, block_ids: Sequence[int]) -> list[bool]:
        """Per block: holds a non-finite value in some layer."""
        return [bool(f) for f in audit_blocks(self.layout, list(block_ids), backend=BACKEND)]
