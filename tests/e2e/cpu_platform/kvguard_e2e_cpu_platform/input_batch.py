"""The standalone CPU model runner's per-step inputs and bookkeeping
(``vllm/v1/worker/cpu/input_batch.py``, ``logprob.py``; vLLM's kernels:
``csrc/cpu/input_batch.cpp``).

Tensors indexed by request-state row (``all_token_ids``, ``num_computed_tokens``,
``prefill_len``, ``last_sampled_tokens``, ``total_len``) are the runner's persistent
state; ``idx_mapping[b]`` is the row of the batch's request ``b``, and
``query_start_loc[b] : query_start_loc[b + 1]`` its tokens in this step. Each op writes
exactly what vLLM's kernel writes and leaves the rest alone.
"""

from __future__ import annotations

import torch

from .library import op


@op(
    "prepare_prefill_inputs_cpu(Tensor(a0!) input_ids, "
    "Tensor(a1!) next_prefill_tokens, Tensor idx_mapping, "
    "Tensor query_start_loc, Tensor all_token_ids, Tensor prefill_len, "
    "Tensor num_computed_tokens) -> ()"
)
def prepare_prefill_inputs_cpu(
    input_ids: torch.Tensor,
    next_prefill_tokens: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    all_token_ids: torch.Tensor,
    prefill_len: torch.Tensor,
    num_computed_tokens: torch.Tensor,
) -> None:
    """For each request still prefilling: its next prompt tokens as this step's input
    ids, and the ``k``-th prompt token after them (0 past the prompt) in
    ``next_prefill_tokens[k, row]``. Decoding requests are left to
    :func:`combine_sampled_and_draft_tokens_cpu`."""
    starts = query_start_loc.tolist()
    prefill, computed = prefill_len.tolist(), num_computed_tokens.tolist()
    for b, row in enumerate(idx_mapping.tolist()):
        done = computed[row]
        if done >= prefill[row]:
            continue
        start, end = starts[b], starts[b + 1]
        input_ids[start:end] = all_token_ids[row, done : done + end - start]
        for k in range(next_prefill_tokens.size(0)):
            pos = done + end - start + k
            next_prefill_tokens[k, row] = all_token_ids[row, pos] if pos < prefill[row] else 0


@op(
    "get_prompt_logprobs_token_ids_cpu("
    "SymInt num_tokens, Tensor query_start_loc, Tensor idx_mapping, "
    "Tensor num_computed_tokens, Tensor all_token_ids) -> Tensor"
)
def get_prompt_logprobs_token_ids_cpu(
    num_tokens: int,
    query_start_loc: torch.Tensor,
    idx_mapping: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    all_token_ids: torch.Tensor,
) -> torch.Tensor:
    """For each scheduled token, the token that follows it (the one its logits score):
    request tokens ``num_computed + 1 ..`` laid out like the batch, int64."""
    token_ids = torch.zeros(num_tokens, dtype=torch.int64)
    starts = query_start_loc.tolist()
    computed = num_computed_tokens.tolist()
    for b, row in enumerate(idx_mapping.tolist()):
        start, end = starts[b], starts[b + 1]
        first = computed[row] + 1
        token_ids[start:end] = all_token_ids[row, first : first + end - start]
    return token_ids


@op(
    "prepare_pos_seq_lens_cpu(Tensor idx_mapping, Tensor query_start_loc, "
    "Tensor num_computed_tokens, Tensor(a3!) pos, "
    "Tensor(a4!) seq_lens) -> ()"
)
def prepare_pos_seq_lens_cpu(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    pos: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Positions ``num_computed ..`` of each request's scheduled tokens, and its
    sequence length after the step (``seq_lens`` past the batch: 0)."""
    starts = query_start_loc.tolist()
    computed = num_computed_tokens.tolist()
    seq_lens[idx_mapping.size(0) :] = 0
    for b, row in enumerate(idx_mapping.tolist()):
        start, end = starts[b], starts[b + 1]
        seq_lens[b] = computed[row] + end - start
        pos[start:end] = torch.arange(computed[row], computed[row] + end - start)


@op(
    "combine_sampled_and_draft_tokens_cpu("
    "Tensor(a0!) input_ids, Tensor idx_mapping, Tensor last_sampled_tokens, "
    "Tensor query_start_loc, Tensor seq_lens, Tensor prefill_len, "
    "Tensor draft_tokens, Tensor cu_num_logits, SymInt num_logits, "
    "SymInt num_new_sampled_tokens) -> Tensor"
)
def combine_sampled_and_draft_tokens_cpu(
    input_ids: torch.Tensor,
    idx_mapping: torch.Tensor,
    last_sampled_tokens: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    prefill_len: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_logits: torch.Tensor,
    num_logits: int,
    num_new_sampled_tokens: int,
) -> torch.Tensor:
    """The batch positions whose logits are sampled (each request's last
    ``cu_num_logits[b + 1] - cu_num_logits[b]`` tokens), int64. For a request past its
    prompt, the input ids of those tokens become the token sampled last step (when
    ``num_new_sampled_tokens`` and the first of them is past the prompt) followed by
    its draft tokens."""
    logits_indices = torch.zeros(num_logits, dtype=torch.int64)
    starts, cu_logits = query_start_loc.tolist(), cu_num_logits.tolist()
    lengths, prefill = seq_lens.tolist(), prefill_len.tolist()
    for b, row in enumerate(idx_mapping.tolist()):
        num_req_logits = cu_logits[b + 1] - cu_logits[b]
        num_drafts = num_req_logits - num_new_sampled_tokens
        end = starts[b + 1]
        first = end - num_req_logits
        logits_indices[cu_logits[b] : cu_logits[b + 1]] = torch.arange(first, end)
        if lengths[b] <= prefill[row]:
            continue  # still in its prompt: the prompt's tokens stay
        if num_new_sampled_tokens > 0 and lengths[b] - num_req_logits >= prefill[row]:
            # (The runner's last_sampled_tokens is [rows, 1].)
            input_ids[first] = last_sampled_tokens[row].reshape(-1)[0]
        input_ids[end - num_drafts : end] = draft_tokens[row, :num_drafts]
    return logits_indices


@op(
    "post_update_cpu(Tensor idx_mapping, "
    "Tensor(a1!) num_computed_tokens, Tensor(a2!) last_sampled_tokens, "
    "Tensor(a3!)? output_bin_counts, Tensor sampled_tokens, "
    "Tensor num_sampled, Tensor num_rejected, Tensor? query_start_loc, "
    "Tensor(a8!) all_token_ids, Tensor(a9!) total_len) -> ()"
)
def post_update_cpu(
    idx_mapping: torch.Tensor,
    num_computed_tokens: torch.Tensor,
    last_sampled_tokens: torch.Tensor,
    output_bin_counts: torch.Tensor | None,
    sampled_tokens: torch.Tensor,
    num_sampled: torch.Tensor,
    num_rejected: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    all_token_ids: torch.Tensor,
    total_len: torch.Tensor,
) -> None:
    """After sampling: append each request's ``num_sampled[b]`` tokens to its
    ``all_token_ids`` (and its output bin counts), remember the last one, and advance
    ``num_computed_tokens`` by the step's tokens less the rejected drafts (by none
    without ``query_start_loc``). Rows ``< 0`` are skipped."""
    sampled, rejected = num_sampled.tolist(), num_rejected.tolist()
    starts = query_start_loc.tolist() if query_start_loc is not None else None
    for b, row in enumerate(idx_mapping.tolist()):
        if row < 0:
            continue
        count = sampled[b]
        if count > 0:
            tokens = sampled_tokens[b, :count]
            length = int(total_len[row])
            last_sampled_tokens[row] = tokens[-1]
            total_len[row] = length + count
            all_token_ids[row, length : length + count] = tokens.to(all_token_ids.dtype)
            if output_bin_counts is not None:
                ones = torch.ones(count, dtype=output_bin_counts.dtype)
                output_bin_counts[row].index_add_(0, tokens, ones)
        query_len = starts[b + 1] - starts[b] if starts is not None else 0
        num_computed_tokens[row] += query_len - rejected[b]
