"""The standalone CPU model runner's block tables (``vllm/v1/worker/cpu/block_table.py``;
vLLM's kernels: ``csrc/cpu/block_table.cpp``).

``idx_mapping[b]`` is the request-state row (in the runner's persistent tables) of the
batch's request ``b``. Each op writes exactly what vLLM's kernel writes and leaves the
rest alone: the runner relies on both (it zeroes the gathered rows itself first).
"""

from __future__ import annotations

import torch

from .library import op


@op(
    "gather_block_table_cpu(Tensor block_table, Tensor(a1!) output, "
    "Tensor idx_mapping, Tensor num_blocks, SymInt num_reqs_padded) -> ()"
)
def gather_block_table_cpu(
    block_table: torch.Tensor,
    output: torch.Tensor,
    idx_mapping: torch.Tensor,
    num_blocks: torch.Tensor,
    num_reqs_padded: int,
) -> None:
    """``output[b, :n] = block_table[idx_mapping[b], :n]`` with ``n`` that request's
    ``num_blocks``; the padding rows ``num_reqs .. num_reqs_padded`` zeroed whole."""
    num_reqs = idx_mapping.size(0)
    counts = num_blocks.tolist()
    for b, row in enumerate(idx_mapping.tolist()):
        output[b, : counts[row]] = block_table[row, : counts[row]]
    output[num_reqs:num_reqs_padded] = 0


@op(
    "compute_slot_mapping_cpu("
    "Tensor block_table, Tensor(a1!) slot_mapping, Tensor idx_mapping, "
    "Tensor query_start_loc, Tensor positions, SymInt block_size, "
    "bool mapping_enabled, SymInt pad_slot_id) -> ()"
)
def compute_slot_mapping_cpu(
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    mapping_enabled: bool,
    pad_slot_id: int,
) -> None:
    """The KV slot of each scheduled token: block ``block_table[row, pos // block_size]``,
    offset ``pos % block_size``. ``pad_slot_id`` for the tokens past the batch, and for
    every token of a group without slots (``mapping_enabled`` false) or of a request
    row ``< 0``."""
    starts = query_start_loc.tolist()
    num_reqs = idx_mapping.size(0)
    slot_mapping[starts[num_reqs] :] = pad_slot_id
    for b, row in enumerate(idx_mapping.tolist()):
        start, end = starts[b], starts[b + 1]
        if not mapping_enabled or row < 0:
            slot_mapping[start:end] = pad_slot_id
            continue
        pos = positions[start:end]
        blocks = block_table[row][pos // block_size].long()
        slot_mapping[start:end] = blocks * block_size + pos % block_size
