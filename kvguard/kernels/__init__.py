"""GPU kernels (Triton) and their pure-torch references for the KV cache kvguard guards.

Importing this package needs torch; Triton is optional (without it, and on CPU tensors
without ``TRITON_INTERPRET=1``, every function runs its torch reference). ``import
kvguard`` never imports this package.

* :class:`KVCacheLayout` — describe the per-layer cache tensors once.
* :func:`zero_blocks` / :func:`zero_slots` — zero blocks / token slots in every layer.
* :func:`count_nonfinite_per_request` — per-request NaN (and ±Inf) counts of logits;
  :func:`sum_rows_per_request` for counts already taken per row.
* :func:`audit_blocks` — per-block "holds a non-finite value" flags.
* :func:`seal_blocks` — per-block 64-bit fingerprints across layers (seals).
* :class:`CacheWiper` — drains a pool's zeroing queues; ``zero_request_tail``.
"""

from kvguard.kernels.audit_blocks import audit_blocks, audit_blocks_ref
from kvguard.kernels.backend import HAS_TRITON, Backend, BackendUnavailableError, resolve_backend
from kvguard.kernels.count_nonfinite import (
    NonFiniteMode,
    count_nonfinite_per_request,
    count_nonfinite_per_request_ref,
    sum_rows_per_request,
)
from kvguard.kernels.layout import KVCacheLayout, LayoutError, LayoutKind, Region
from kvguard.kernels.seal_blocks import seal_blocks, seal_blocks_ref
from kvguard.kernels.wiper import CacheWiper, FlushResult, TailWipe, ZeroingSource
from kvguard.kernels.zero_blocks import zero_blocks, zero_blocks_ref
from kvguard.kernels.zero_slots import slot_ids, zero_slots, zero_slots_ref

__all__ = [
    "HAS_TRITON",
    "Backend",
    "BackendUnavailableError",
    "CacheWiper",
    "FlushResult",
    "KVCacheLayout",
    "LayoutError",
    "LayoutKind",
    "NonFiniteMode",
    "Region",
    "TailWipe",
    "ZeroingSource",
    "audit_blocks",
    "audit_blocks_ref",
    "count_nonfinite_per_request",
    "count_nonfinite_per_request_ref",
    "resolve_backend",
    "seal_blocks",
    "seal_blocks_ref",
    "slot_ids",
    "sum_rows_per_request",
    "zero_blocks",
    "zero_blocks_ref",
    "zero_slots",
    "zero_slots_ref",
]
