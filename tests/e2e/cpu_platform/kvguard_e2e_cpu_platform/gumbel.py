"""The standalone CPU model runner's sampler (``vllm/v1/worker/cpu/gumbel.py``; vLLM's
kernel: ``gumbel_sample_cpu`` in ``csrc/cpu/sampling_kernels.cpp`` and
``csrc/cpu/sampling/common.h``).

Greedy rows (temperature 0) take the first largest logit, NaN ignored, as vLLM's
kernel does. Other rows take Gumbel-max, ``argmax(logit / temperature + g)``, with the
kernel's noise: ``g`` is a function of (request seed, position, token id) through
MurmurHash3, so a seeded request samples the same tokens in any batch. The arithmetic
follows the kernel's, but its float rounding is not guaranteed bit for bit: sampled
tokens may differ from vLLM's CPU build in rare near-ties; greedy ones do not.
"""

from __future__ import annotations

import torch

from .library import op

_U32 = 0xFFFFFFFF
DRAFT_NOISE_SALT = 1 << 30
"""Added to the position of a draft proposal's noise (a stream of its own)."""


def _mul32(a: torch.Tensor, b: int) -> torch.Tensor:
    """``a * b`` modulo 2**32 for uint32 values held in int64, in two 16-bit halves of
    ``b`` so that no product overflows int64."""
    return (a * (b & 0xFFFF) + (((a * (b >> 16)) & 0xFFFF) << 16)) & _U32


def _rotl32(x: torch.Tensor, shift: int) -> torch.Tensor:
    return ((x << shift) | (x >> (32 - shift))) & _U32


def _mix(hash_: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    key = _mul32(_rotl32(_mul32(key, 0xCC9E2D51), 15), 0x1B873593)
    hash_ = _rotl32(hash_ ^ key, 13)
    return (_mul32(hash_, 5) + 0xE6546B64) & _U32


def _fmix(hash_: torch.Tensor) -> torch.Tensor:
    hash_ = _mul32(hash_ ^ (hash_ >> 16), 0x85EBCA6B)
    hash_ = _mul32(hash_ ^ (hash_ >> 13), 0xC2B2AE35)
    return hash_ ^ (hash_ >> 16)


def murmur3_hash32(
    seed: int, position: int, token_ids: torch.Tensor, domain: int = 0
) -> torch.Tensor:
    """The kernel's ``murmur3_hash32`` of every token id (int64 tensor of uint32s)."""
    prefix = torch.tensor(domain, dtype=torch.int64)
    for word in (seed & _U32, (seed >> 32) & _U32, position & _U32):
        prefix = _mix(prefix, torch.tensor(word, dtype=torch.int64))
    return _fmix(_mix(prefix.expand_as(token_ids), token_ids) ^ 16)


def _log1p_neg_stable(u: torch.Tensor) -> torch.Tensor:
    """``log(1 - u)`` in fp32: below 0.25 the kernel's degree-8 series, which keeps
    the low bits of a small ``u`` that forming ``1 - u`` would lose."""
    poly = torch.full_like(u, 1.0 / 8.0)
    for k in (7, 6, 5, 4, 3, 2):
        poly = 1.0 / k + u * poly
    series = -u * (1.0 + u * poly)
    direct = torch.log(torch.clamp(1.0 - u, min=5.960464477539063e-08))
    return torch.where(u < 0.25, series, direct)


def gumbel_noise(seed: int, position: int, vocab_size: int, fp64: bool) -> torch.Tensor:
    """The kernel's Gumbel noise of tokens ``0 .. vocab_size - 1`` (fp32 or fp64)."""
    token_ids = torch.arange(vocab_size, dtype=torch.int64)
    low = murmur3_hash32(seed, position, token_ids)
    if fp64:
        high = murmur3_hash32(seed, position, token_ids, domain=0x9E3779B9)
        bits53 = (high << 21) | (low >> 11)  # ((high << 32) | low) >> 11, no overflow
        u = (bits53.double() + 0.5) * 2.0**-53
        u = torch.where(u == 1.0, u - 2.0**-53, u)
        return -torch.log(-torch.log(u))
    # (Two exact int-to-float conversions, as in the kernel.)
    u = (low >> 16).float() * 1.52587890625e-05 + (
        (low & 0xFFFF).float() + 0.5
    ) * 2.3283064365386963e-10
    return -torch.log(-_log1p_neg_stable(u))


def _first_argmax(scores: torch.Tensor) -> int:
    """The first largest score, NaN never chosen (the kernel's strict ``>`` scan from
    -inf); 0 when none beats -inf."""
    scores = torch.where(scores.isnan(), float("-inf"), scores)
    return int(scores.argmax())  # (torch.argmax returns the first maximal index)


@op(
    "gumbel_sample_cpu(Tensor logits, Tensor expanded_idx_mapping, "
    "Tensor temperature, Tensor seeds, Tensor positions, "
    "bool apply_temperature, bool is_drafting, bool use_fp64) -> Tensor"
)
def gumbel_sample_cpu(
    logits: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    apply_temperature: bool,
    is_drafting: bool,
    use_fp64: bool,
) -> torch.Tensor:
    """One token per logits row, int64. Row ``t`` belongs to request-state row
    ``expanded_idx_mapping[t]`` (``< 0``: padding, greedy) and sits at
    ``positions[t]``."""
    out = torch.empty(logits.size(0), dtype=torch.int64)
    temps, seeds_ = temperature.tolist(), seeds.tolist()
    for t, (row, position) in enumerate(
        zip(expanded_idx_mapping.tolist(), positions.tolist(), strict=True)
    ):
        temp = temps[row] if row >= 0 else 0.0
        if temp == 0.0:
            out[t] = _first_argmax(logits[t].float())
            continue
        dtype = torch.float64 if use_fp64 else torch.float32
        scaled = logits[t].float()
        if apply_temperature:
            scaled = scaled / torch.tensor(temp, dtype=torch.float32)
        position += DRAFT_NOISE_SALT if is_drafting else 0
        noise = gumbel_noise(seeds_[row], position, logits.size(1), use_fp64)
        out[t] = _first_argmax(scaled.to(dtype) + noise)
    return out
