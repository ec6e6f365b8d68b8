"""Logit bias, allowed token ids and min_tokens in the standalone CPU model runner
(``vllm/v1/worker/cpu/logits_processors.py``; vLLM's kernel: ``apply_logit_bias_cpu`` in
``csrc/cpu/sampling_kernels.cpp``)."""

from __future__ import annotations

import torch

from .library import op


@op(
    "apply_logit_bias_cpu(Tensor(a0!) logits, "
    "Tensor expanded_idx_mapping, Tensor positions, "
    "Tensor num_allowed_token_ids, Tensor allowed_token_ids, "
    "Tensor num_logit_bias, Tensor logit_bias_token_ids, "
    "Tensor logit_bias, Tensor min_lens, Tensor num_stop_token_ids, "
    "Tensor restore_when_all_masked, Tensor stop_token_ids, "
    "bool check_all_masked_rows) -> ()"
)
def apply_logit_bias_cpu(
    logits: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    positions: torch.Tensor,
    num_allowed_token_ids: torch.Tensor,
    allowed_token_ids: torch.Tensor,
    num_logit_bias: torch.Tensor,
    logit_bias_token_ids: torch.Tensor,
    logit_bias: torch.Tensor,
    min_lens: torch.Tensor,
    num_stop_token_ids: torch.Tensor,
    restore_when_all_masked: torch.Tensor,
    stop_token_ids: torch.Tensor,
    check_all_masked_rows: bool,
) -> None:
    """In place, per logits row ``t`` of request-state row ``r``, in this order:

    1. allowed token ids: every other logit becomes -inf;
    2. logit bias: ``logits[t, id] += bias``;
    3. min_tokens: while ``positions[t] + 1 < min_lens[r]``, the stop tokens become
       -inf -- put back (the finite ones) if that leaves the whole row -inf and the
       request asks for it (``check_all_masked_rows`` and ``restore_when_all_masked``).
    """
    num_allowed, num_bias = num_allowed_token_ids.tolist(), num_logit_bias.tolist()
    min_len, num_stop = min_lens.tolist(), num_stop_token_ids.tolist()
    restore = restore_when_all_masked.tolist()
    for t, (r, position) in enumerate(
        zip(expanded_idx_mapping.tolist(), positions.tolist(), strict=True)
    ):
        row = logits[t]
        if num_allowed[r] > 0:
            allowed = allowed_token_ids[r, : num_allowed[r]].long()
            kept = row[allowed].clone()
            row.fill_(float("-inf"))
            row[allowed] = kept
        if num_bias[r] > 0:
            ids = logit_bias_token_ids[r, : num_bias[r]].long()
            # (index_put_ with accumulate: a token listed twice gets both biases.)
            row.index_put_((ids,), logit_bias[r, : num_bias[r]].to(row.dtype), accumulate=True)
        if num_stop[r] == 0 or position + 1 >= min_len[r]:
            continue
        stops = stop_token_ids[r, : num_stop[r]].long()
        saved = row[stops].clone()
        row[stops] = float("-inf")
        if check_all_masked_rows and restore[r] != 0 and bool((row == float("-inf")).all()):
            finite = saved.isfinite()
            row[stops[finite]] = saved[finite]
