"""Count non-finite logits per request in one launch, without a host synchronisation.

Validation of a step needs one number per *request*, while logits come per *row*: with
speculative decoding a request owns several consecutive rows (its draft positions), and a
request may own none in a step. ``cu_rows`` (cumulative rows, like FlashAttention's
``cu_seqlens``) says which rows belong to whom::

    cu_rows = [0, 1, 4, 4, 6]     request 0: row 0; request 1: rows 1..3;
                                  request 2: no rows; request 3: rows 4..5

The result stays on the device, so the engine can hand it to its async output path and
read it when the step's output is read anyway.
"""

from __future__ import annotations

import enum

import torch

from kvguard.kernels._addressing import NONFINITE_BITS, chunk_words, int_view
from kvguard.kernels.backend import (
    HAS_TRITON,
    Backend,
    default_max_programs,
    launch_grid,
    resolve_backend,
    tl,
    triton,
)

__all__ = ["NonFiniteMode", "count_nonfinite_per_request", "count_nonfinite_per_request_ref"]


class NonFiniteMode(enum.Enum):
    """What counts as bad."""

    NAN = "nan"
    """NaN only (what vLLM's ``num_nans_in_logits`` counts)."""
    NAN_OR_INF = "nan_or_inf"
    """NaN, +Inf and -Inf."""


if HAS_TRITON:

    @triton.jit  # type: ignore[untyped-decorator]
    def _count_nonfinite_kernel(
        bits_ptr: tl.tensor,  # [num_rows, vocab] logits read as same-width integers (raw bits)
        cu_rows_ptr: tl.tensor,  # int32/int64 [num_requests + 1]: request r owns cu[r]:cu[r+1]
        out_ptr: tl.tensor,  # int32 [num_requests]: the counts; every entry is written (no memset)
        num_requests: tl.tensor,  # entries of out_ptr
        num_rows: tl.tensor,  # rows of the logits: row ranges are clamped to [0, num_rows)
        vocab: tl.tensor,  # columns of the logits
        row_stride: tl.tensor,  # elements from row i to row i + 1
        col_stride: tl.tensor,  # elements from column j to column j + 1
        EXP_MASK: tl.constexpr,  # exponent bits: all set <=> NaN or +-Inf
        MANT_MASK: tl.constexpr,  # mantissa bits: some set (with EXP_MASK) <=> NaN
        NAN_ONLY: tl.constexpr,  # count NaN only, not +-Inf
        BLOCK: tl.constexpr,  # columns per load (power of two)
    ) -> None:
        pid = tl.program_id(0).to(tl.int64)
        num_programs = tl.num_programs(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        # One program per request (grid-stride past the grid cap): each count is the sum
        # of one program's lanes, so no atomics, no zero-initialised output, and the
        # result is deterministic.
        for req in range(pid, num_requests, num_programs):
            # Clamp instead of trusting cu_rows: checking it would need a host sync, and
            # a bad range must not read outside the logits (it counts 0 rows instead).
            start = tl.load(cu_rows_ptr + req).to(tl.int64)
            end = tl.load(cu_rows_ptr + req + 1).to(tl.int64)
            start = tl.minimum(tl.maximum(start, 0), num_rows)
            end = tl.minimum(tl.maximum(end, start), num_rows)
            acc = tl.zeros([BLOCK], dtype=tl.int32)
            for row in range(start, end):
                row_ptr = bits_ptr + row * row_stride  # int64: rows * vocab passes 2**31
                for col0 in range(0, vocab, BLOCK):
                    col = col0 + cols
                    bits = tl.load(row_ptr + col * col_stride, mask=col < vocab, other=0)
                    bad = (bits & EXP_MASK) == EXP_MASK
                    if NAN_ONLY:
                        bad = bad & ((bits & MANT_MASK) != 0)
                    acc += bad.to(tl.int32)
            tl.store(out_ptr + req, tl.sum(acc, axis=0))


def count_nonfinite_per_request_ref(
    logits: torch.Tensor, cu_rows: torch.Tensor, mode: NonFiniteMode = NonFiniteMode.NAN
) -> torch.Tensor:
    """Pure-torch count (test oracle and fallback); also free of host synchronisation.

    Same contract as :func:`count_nonfinite_per_request`, including the clamping of
    malformed ``cu_rows`` ranges.
    """
    values = logits.float() if logits.element_size() == 1 else logits  # float8: no isnan
    bad = torch.isnan(values) if mode is NonFiniteMode.NAN else ~torch.isfinite(values)
    per_row = bad.sum(dim=-1)
    # Segment sum by differences of a prefix sum: gathers only, no .item().
    prefix = torch.zeros(logits.shape[0] + 1, dtype=torch.int64, device=logits.device)
    prefix[1:] = per_row.cumsum(0)
    bounds = cu_rows.to(torch.int64).clamp(0, logits.shape[0])
    start = bounds[:-1]
    end = torch.maximum(bounds[1:], start)
    return (prefix[end] - prefix[start]).to(torch.int32)


def count_nonfinite_per_request(
    logits: torch.Tensor,
    cu_rows: torch.Tensor,
    mode: NonFiniteMode | str = NonFiniteMode.NAN,
    *,
    backend: Backend = "auto",
    max_programs: int | None = None,
) -> torch.Tensor:
    """Non-finite values per request: int32 ``[num_requests]`` on ``logits.device``.

    ``logits``: ``[num_rows, vocab]`` fp32/fp16/bf16 (float8 too), any strides.
    ``cu_rows``: int32/int64 ``[num_requests + 1]`` on the same device, non-decreasing,
    ``cu_rows[0] == 0`` and ``cu_rows[-1] <= num_rows``; request ``r`` owns rows
    ``cu_rows[r]:cu_rows[r + 1]`` (empty allowed). The values are not checked (that
    would need a host sync); a malformed range is clamped into the logits and never read
    out of bounds. ``mode``: :class:`NonFiniteMode` or its value (``"nan"``,
    ``"nan_or_inf"``).

    One launch; no ``.item()``: nothing here waits for the GPU.
    """
    mode = NonFiniteMode(mode)
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_rows, vocab], got shape {tuple(logits.shape)}")
    if logits.dtype not in NONFINITE_BITS:
        raise ValueError(
            f"logits dtype {logits.dtype} is not a supported float type "
            f"({', '.join(str(d) for d in NONFINITE_BITS)})"
        )
    index_dtypes = (torch.int32, torch.int64)
    if cu_rows.dim() != 1 or cu_rows.numel() < 1 or cu_rows.dtype not in index_dtypes:
        raise ValueError(
            f"cu_rows must be a 1-D int32/int64 tensor [num_requests + 1], got "
            f"{cu_rows.dtype} of shape {tuple(cu_rows.shape)}"
        )
    if cu_rows.device != logits.device:
        raise ValueError(f"cu_rows is on {cu_rows.device}, logits on {logits.device}")
    num_requests = cu_rows.numel() - 1
    if resolve_backend(backend, logits.device) == "torch":
        return count_nonfinite_per_request_ref(logits, cu_rows, mode)
    out = torch.empty(num_requests, dtype=torch.int32, device=logits.device)
    if num_requests == 0:
        return out
    exp_mask, mant_mask = NONFINITE_BITS[logits.dtype]
    num_rows, vocab = logits.shape
    max_programs = max_programs or default_max_programs(logits.device)
    _count_nonfinite_kernel[launch_grid(num_requests, max_programs)](
        int_view(logits),
        cu_rows.contiguous(),
        out,
        num_requests,
        num_rows,
        vocab,
        logits.stride(0),
        logits.stride(1),
        EXP_MASK=exp_mask,
        MANT_MASK=mant_mask,
        NAN_ONLY=mode is NonFiniteMode.NAN,
        BLOCK=chunk_words(vocab, cap=4096),
    )
    return out
