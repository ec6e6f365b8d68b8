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

__all__ = [
    "NonFiniteMode",
    "count_nonfinite_per_request",
    "count_nonfinite_per_request_ref",
    "sum_rows_per_request",
]

# Launch shape, measured on an H200 (docs/kernels.md, "Speed"): columns one load reads at
# most, the work items to aim for per program (how finely columns are split), warps per
# program, and software-pipeline stages.
COLUMNS_PER_LOAD = 1024
ITEMS_PER_PROGRAM = 2
NUM_WARPS = 4
NUM_STAGES = 4


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
        out_ptr: tl.tensor,  # int32 [num_requests], zero-filled: the counts are added in
        num_items: tl.tensor,  # num_requests * num_splits
        num_splits: tl.tensor,  # column ranges each request's rows are cut into
        cols_per_split: tl.tensor,  # columns of one range (a multiple of BLOCK)
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
        # An item is one request's rows over one range of columns, so that a batch of few
        # requests still spreads over the whole GPU. Partial counts are added with an
        # atomic, only where non-zero (clean logits issue none); integer sums make the
        # result deterministic all the same.
        for item in range(pid, num_items, num_programs):
            req = item // num_splits
            col_lo = (item % num_splits) * cols_per_split
            col_hi = tl.minimum(col_lo + cols_per_split, vocab)
            # Clamp instead of trusting cu_rows: checking it would need a host sync, and
            # a bad range must not read outside the logits (it counts 0 rows instead).
            start = tl.load(cu_rows_ptr + req).to(tl.int64)
            end = tl.load(cu_rows_ptr + req + 1).to(tl.int64)
            start = tl.minimum(tl.maximum(start, 0), num_rows)
            end = tl.minimum(tl.maximum(end, start), num_rows)
            acc = tl.zeros([BLOCK], dtype=tl.int32)
            for row in range(start, end):
                row_ptr = bits_ptr + row * row_stride  # int64: rows * vocab passes 2**31
                for col0 in range(col_lo, col_hi, BLOCK):
                    col = col0 + cols
                    bits = tl.load(row_ptr + col * col_stride, mask=col < col_hi, other=0)
                    bad = (bits & EXP_MASK) == EXP_MASK
                    if NAN_ONLY:
                        bad = bad & ((bits & MANT_MASK) != 0)
                    acc += bad.to(tl.int32)
            total = tl.sum(acc, axis=0)
            tl.atomic_add(out_ptr + req, total, mask=total > 0)


def count_nonfinite_per_request_ref(
    logits: torch.Tensor, cu_rows: torch.Tensor, mode: NonFiniteMode = NonFiniteMode.NAN
) -> torch.Tensor:
    """Pure-torch count (test oracle and fallback); also free of host synchronisation.

    Same contract as :func:`count_nonfinite_per_request`, including the clamping of
    malformed ``cu_rows`` ranges.
    """
    values = logits.float() if logits.element_size() == 1 else logits  # float8: no isnan
    bad = torch.isnan(values) if mode is NonFiniteMode.NAN else ~torch.isfinite(values)
    return sum_rows_per_request(bad.sum(dim=-1), cu_rows)


def sum_rows_per_request(per_row: torch.Tensor, cu_rows: torch.Tensor) -> torch.Tensor:
    """Per-row counts ``[num_rows]`` summed per request: int32 ``[num_requests]``.

    ``cu_rows`` as for :func:`count_nonfinite_per_request` (a malformed range is clamped
    into the rows, never read out of bounds). For counts an engine already took per row
    (vLLM's ``num_nans`` under speculative decoding). Gathers on the device only: no
    host synchronisation.
    """
    num_rows = per_row.shape[0]
    # Segment sum by differences of a prefix sum: gathers only, no .item().
    prefix = torch.zeros(num_rows + 1, dtype=torch.int64, device=per_row.device)
    prefix[1:] = per_row.cumsum(0)
    bounds = cu_rows.to(device=per_row.device, dtype=torch.int64).clamp(0, num_rows)
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

    One kernel launch (after the zero fill of the output); no ``.item()``: nothing here
    waits for the GPU.
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
    out = torch.zeros(num_requests, dtype=torch.int32, device=logits.device)
    if num_requests == 0:
        return out
    exp_mask, mant_mask = NONFINITE_BITS[logits.dtype]
    num_rows, vocab = logits.shape
    max_programs = max_programs or default_max_programs(logits.device)
    block = chunk_words(vocab, cap=COLUMNS_PER_LOAD)
    # Cut each request's columns into as many ranges as it takes to give every program
    # an item (the request count is known here without a sync; its rows are not).
    chunks = -(-vocab // block)
    num_splits = max(1, min(chunks, -(-max_programs * ITEMS_PER_PROGRAM // num_requests)))
    cols_per_split = -(-chunks // num_splits) * block
    num_splits = -(-vocab // cols_per_split)
    num_items = num_requests * num_splits
    _count_nonfinite_kernel[launch_grid(num_items, max_programs)](
        int_view(logits),
        cu_rows.contiguous(),
        out,
        num_items,
        num_splits,
        cols_per_split,
        num_rows,
        vocab,
        logits.stride(0),
        logits.stride(1),
        EXP_MASK=exp_mask,
        MANT_MASK=mant_mask,
        NAN_ONLY=mode is NonFiniteMode.NAN,
        BLOCK=block,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return out
