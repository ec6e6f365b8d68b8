"""The KV audit (``{"kvguard": {"audit": true}}``): the scheduler sends each step's
filled blocks, the workers scan exactly those for NaN and infinities and add the
flagged blocks to the request's NaN count, and such a step fails as for NaN logits.

Worker side on caches with sentinel values (vLLM's real runner classes patched, their
step stood in for); scheduler side on vLLM's real scheduler. The real-engine test is
tests/e2e/test_kv_audit.py."""

from __future__ import annotations

import logging
import pickle
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

import torch  # noqa: E402

from kvguard import BlockState  # noqa: E402
from kvguard.adapters.vllm._compat import has_v1_model_runner  # noqa: E402
from kvguard.adapters.vllm.pool.block_pool import GuardModeUnsupported  # noqa: E402
from kvguard.adapters.vllm.workers import audit as worker_audit  # noqa: E402
from kvguard.adapters.vllm.workers import caches as worker_caches  # noqa: E402
from kvguard.adapters.vllm.workers import nans as worker_nans  # noqa: E402
from kvguard.adapters.vllm.workers.audit import AuditedCounts  # noqa: E402

from .conftest import undo_runner_patches_after  # noqa: E402
from .harness import (  # noqa: E402
    BLOCK,
    finish_reasons,
    make_request,
    make_scheduler,
    model_output,
)

BLOCKS, HEADS, SIZE, DIM = 6, 2, 4, 3


def _runner(backend: str = "FLASH_ATTN", layers: int = 2, kernel_split: int = 1) -> Any:
    """What the audit reads of a model runner: its attention groups, the layers' caches
    (sentinel 7.0 + layer) in the backend's layout, and the scheduler's block count.
    ``kernel_split``: kernel blocks per scheduler block."""
    kernel_blocks = BLOCKS * kernel_split
    kernel_size = SIZE // kernel_split
    shape = {
        "FLASH_ATTN": (2, kernel_blocks, kernel_size, HEADS, DIM),
        "CPU_ATTN": (kernel_blocks, HEADS, kernel_size, 2 * DIM),
    }.get(backend, (2, kernel_blocks, kernel_size, HEADS, DIM))
    context = {
        f"layer{i}": SimpleNamespace(kv_cache=torch.full(shape, 7.0 + i)) for i in range(layers)
    }
    group = SimpleNamespace(
        backend=SimpleNamespace(get_name=lambda: backend), layer_names=list(context)
    )
    return SimpleNamespace(
        attn_groups=[[group]],
        compilation_config=SimpleNamespace(static_forward_context=context),
        kv_cache_config=SimpleNamespace(num_blocks=BLOCKS),
    )


def _cache(runner: Any, layer: int) -> torch.Tensor:
    cache: torch.Tensor = runner.compilation_config.static_forward_context[f"layer{layer}"].kv_cache
    return cache


def test_exactly_the_blocks_holding_nan_or_inf_count_per_request() -> None:
    """Block 1 holds a NaN in layer 1's V, block 4 an inf in layer 0's K; blocks 2 and 5
    (not audited) hold NaN too. Request a (blocks 1, 3) has one flagged block, b (4)
    one, c (0) none; the unaudited blocks are not read."""
    runner = _runner()
    _cache(runner, 1)[1, 1, 3, 1, 2] = float("nan")
    _cache(runner, 0)[0, 4, 0, 0, 0] = float("inf")
    _cache(runner, 0)[0, 2, 0, 0, 0] = float("nan")
    _cache(runner, 1)[1, 5, 2, 1, 1] = float("-inf")
    flagged = worker_audit.audit_requests(runner, {"a": [1, 3], "b": [4], "c": [0]})
    assert flagged.tolist() == [1, 1, 0]
    assert flagged.dtype == torch.int32


def test_cpu_attention_blocks_are_audited_whole() -> None:
    """vLLM's CPU caches, [blocks, heads, block_size, 2 * head_dim]: a non-finite value
    anywhere in a block flags it, whatever order the ISA kernels keep inside."""
    runner = _runner("CPU_ATTN")
    _cache(runner, 0)[2, 1, 3, 5] = float("nan")  # the block's last byte run
    _cache(runner, 1)[3, 0, 0, 0] = float("inf")  # its first
    flagged = worker_audit.audit_requests(runner, {"a": [1, 2], "b": [3], "c": [4]})
    assert flagged.tolist() == [1, 1, 0]


def test_kernel_blocks_are_audited_as_the_schedulers_block() -> None:
    """A backend splitting each scheduler block into two kernel blocks: scheduler block
    b is kernel blocks 2b and 2b + 1."""
    runner = _runner(kernel_split=2)
    _cache(runner, 0)[0, 2 * 3 + 1, 1, 0, 0] = float("nan")  # scheduler block 3
    flagged = worker_audit.audit_requests(runner, {"a": [3], "b": [2], "c": [4]})
    assert flagged.tolist() == [1, 0, 0]


def test_an_unknown_backend_is_refused_not_skipped() -> None:
    runner = _runner("SOME_NEW_BACKEND")
    with pytest.raises(GuardModeUnsupported, match="attention backend SOME_NEW_BACKEND"):
        worker_audit.audit_requests(runner, {"a": [1]})
    assert not worker_caches.LAYOUT_OF_BACKEND.get("SOME_NEW_BACKEND")


def test_audited_counts_keep_their_findings_across_processes() -> None:
    counts = AuditedCounts({"a": 2, "b": 0}, {"a": 1, "c": 3})
    assert dict(counts) == {"a": 3, "b": 0, "c": 3}
    again = pickle.loads(pickle.dumps(counts))
    assert dict(again) == dict(counts) and again.kv_audit == {"a": 1, "c": 3}


# ---------------------------------------------------------------- vLLM's runners


def _v1() -> Any:
    if not has_v1_model_runner():
        pytest.skip("vLLM 0.34 has no V1 model runner")
    import vllm.v1.worker.gpu_model_runner as v1

    return v1.GPUModelRunner


def test_v1_adds_the_findings_to_the_counts_it_reads_back(monkeypatch: pytest.MonkeyPatch) -> None:
    undo_runner_patches_after(monkeypatch)
    cls = _v1()

    def stock(self: Any, scheduler_output: Any, *args: Any) -> tuple[Any, ...]:
        return ({"a": 0, "b": 2}, None, "rest")

    monkeypatch.setattr(cls, "_bookkeeping_sync", stock)
    worker_audit.install()
    worker_audit.install()  # idempotent: one wrapper
    patched = cls._bookkeeping_sync
    assert patched.__wrapped__ is stock
    runner = _runner()
    _cache(runner, 0)[0, 4, 0, 0, 0] = float("nan")
    out = patched(runner, SimpleNamespace(kvguard_blocks_to_audit={"a": [4], "b": [1]}))
    counts, device, rest = out
    assert (dict(counts), counts.kv_audit, device, rest) == (
        {"a": 1, "b": 2},
        {"a": 1},
        None,
        "rest",
    )
    clean = patched(runner, SimpleNamespace(kvguard_blocks_to_audit={"a": [1]}))
    assert clean == ({"a": 0, "b": 2}, None, "rest") and clean[0].kv_audit == {}
    assert patched(runner, SimpleNamespace()) == ({"a": 0, "b": 2}, None, "rest")


def test_v1_async_adds_the_findings_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under async scheduling V1 keeps its counts on the device (rows in the input
    batch's order): the flags are added there."""
    undo_runner_patches_after(monkeypatch)
    cls = _v1()
    device_counts = torch.tensor([0, 5, 0], dtype=torch.int32)

    def stock(self: Any, scheduler_output: Any, *args: Any) -> tuple[Any, ...]:
        return ({}, device_counts, "rest")

    monkeypatch.setattr(cls, "_bookkeeping_sync", stock)
    worker_audit.install()
    runner = _runner()
    runner.input_batch = SimpleNamespace(req_id_to_index={"x": 0, "a": 1, "b": 2})
    _cache(runner, 1)[1, 2, 0, 0, 0] = float("nan")
    _cache(runner, 0)[0, 3, 0, 0, 0] = float("inf")
    blocks = {"b": [2, 3], "a": [1]}
    counts, device, _ = cls._bookkeeping_sync(
        runner, SimpleNamespace(kvguard_blocks_to_audit=blocks)
    )
    assert counts == {} and device is device_counts
    assert device_counts.tolist() == [0, 5, 2]


def _v2_runner_class(which: str) -> Any:
    """vLLM's V2 GPU runner, or 0.34's standalone CPU runner (a V2 runner of its own)."""
    if which == "V2":
        import vllm.v1.worker.gpu.model_runner as v2

        return v2.GPUModelRunner
    cpu = pytest.importorskip(
        worker_nans.CPU_RUNNER, reason="vLLM's standalone CPU runner comes with 0.34"
    )
    return cpu.StandaloneCPUModelRunner


@pytest.mark.parametrize("which", ["V2", "CPU"])
def test_v2_adds_the_findings_to_the_samplers_counts(
    which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    undo_runner_patches_after(monkeypatch)
    cls = _v2_runner_class(which)
    sampled = SimpleNamespace(num_nans=torch.tensor([1, 0], dtype=torch.int32))

    def update_requests(self: Any, scheduler_output: Any) -> None:
        return None

    def sample(self: Any, hidden_states: Any, input_batch: Any, grammar: Any) -> Any:
        return (sampled, "num_sampled", "num_rejected")

    monkeypatch.setattr(cls, "update_requests", update_requests)
    monkeypatch.setattr(cls, "sample", sample)
    worker_audit.install()
    runner = _runner()
    _cache(runner, 0)[1, 5, 3, 1, 2] = float("nan")
    cls.update_requests(runner, SimpleNamespace(kvguard_blocks_to_audit={"b": [5], "a": [0]}))
    batch = SimpleNamespace(req_ids=["a", "b"])
    assert cls.sample(runner, None, batch, None)[0] is sampled
    assert sampled.num_nans.tolist() == [1, 1]
    cls.update_requests(runner, SimpleNamespace())  # a step without: nothing added
    cls.sample(runner, None, batch, None)
    assert sampled.num_nans.tolist() == [1, 1]
    assert worker_audit.runner_audits(runner) is False  # (a stand-in, not a V2 runner)
    real = cls.__new__(cls)  # the patched class with the stand-in's caches: it audits
    real.__dict__.update(vars(runner))
    assert worker_audit.runner_audits(real) is True


def test_cpu_runner_tells_the_findings_apart_from_nan_logits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """0.34's standalone CPU runner reads its counts back in ``sample_tokens``: they come
    back as :class:`AuditedCounts`, naming what the audit flagged (as V1's sync path)."""
    undo_runner_patches_after(monkeypatch)
    cls = _v2_runner_class("CPU")
    batch = SimpleNamespace(req_ids=["a", "b", "c"])

    def update_requests(self: Any, scheduler_output: Any) -> None:
        return None

    def sample(self: Any, hidden_states: Any, input_batch: Any, grammar: Any) -> Any:
        nans = torch.tensor([1, 0, 0], dtype=torch.int32)  # a's logits: one NaN
        return (SimpleNamespace(num_nans=nans), "num_sampled", "num_rejected")

    def sample_tokens(self: Any, grammar_output: Any) -> Any:  # (vLLM's, in short)
        sampled = cls.sample(self, None, batch, grammar_output)[0]
        counts = dict(zip(batch.req_ids, sampled.num_nans.tolist(), strict=True))
        return SimpleNamespace(num_nans_in_logits=counts)

    for name, stand_in in [
        ("update_requests", update_requests),
        ("sample", sample),
        ("sample_tokens", sample_tokens),
    ]:
        monkeypatch.setattr(cls, name, stand_in)
    worker_audit.install()
    runner = _runner()
    _cache(runner, 1)[0, 2, 0, 0, 0] = float("inf")  # (FLASH_ATTN: [K|V, block, ...])
    cls.update_requests(runner, SimpleNamespace(kvguard_blocks_to_audit={"a": [1], "b": [2]}))
    counts = cls.sample_tokens(runner, None).num_nans_in_logits
    assert isinstance(counts, AuditedCounts)
    assert dict(counts) == {"a": 1, "b": 1, "c": 0} and counts.kv_audit == {"b": 1}
    cls.update_requests(runner, SimpleNamespace())  # a step without: vLLM's plain counts
    counts = cls.sample_tokens(runner, None).num_nans_in_logits
    assert type(counts) is dict and counts == {"a": 1, "b": 0, "c": 0}


# ---------------------------------------------------------------- the scheduler


def _audited(audit: bool = True) -> Any:
    return make_scheduler(kvguard={"audit": audit})


def test_each_step_carries_the_blocks_it_fills_and_only_with_the_audit_on() -> None:
    prompt = list(range(100, 100 + 4 * BLOCK + 8))  # a chunk of 4 blocks, then 8 tokens
    s = _audited()
    s.add_request(make_request("a", prompt, max_tokens=2))
    so = s.schedule()  # the first chunk fills blocks 0..3
    (blocks,) = s.kv_cache_manager.get_block_ids("a")
    assert so.kvguard_blocks_to_audit == {"a": list(blocks[:4])}
    s.update_from_output(so, model_output(s, so))
    so = s.schedule()  # the last 8 tokens fill nothing
    assert getattr(so, "kvguard_blocks_to_audit", None) is None
    assert s.kvguard_stats()["blocks_audited"] == 4
    off = _audited(audit=False)
    off.add_request(make_request("a", prompt, max_tokens=2))
    assert getattr(off.schedule(), "kvguard_blocks_to_audit", None) is None


def test_a_step_whose_filled_kv_is_not_finite_fails_as_for_nan_logits(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The worker's counts say a's filled block holds NaN (its logits were finite): a is
    ended with an error, its filled blocks quarantined, never published; b beside it
    validates. The log names the KV audit as the cause."""
    s = _audited()
    s.add_request(make_request("a", list(range(100, 100 + BLOCK)), max_tokens=2))
    s.add_request(make_request("b", list(range(200, 200 + BLOCK)), max_tokens=2))
    so = s.schedule()
    (a_blocks,) = s.kv_cache_manager.get_block_ids("a")
    (b_blocks,) = s.kv_cache_manager.get_block_ids("b")
    out = model_output(s, so)
    out.num_nans_in_logits = AuditedCounts({"a": 0, "b": 0}, {"a": 1})
    with caplog.at_level(logging.WARNING, logger="vllm.kvguard"):
        reasons = finish_reasons(s.update_from_output(so, out))
    assert reasons == {"a": "error"}
    pool = s.kvguard_pool.core
    assert pool.block_state(a_blocks[0]) is BlockState.QUARANTINED
    assert pool.block_state(b_blocks[0]) is BlockState.PUBLISHED
    stats = s.kvguard_stats()
    assert (stats["requests_aborted"], stats["requests_failed_audit"]) == (1, 1)
    (line,) = [r.getMessage() for r in caplog.records if "aborted request" in r.getMessage()]
    assert (
        "had NaN or infinite KV in 1 block(s) it filled (KV audit); its logits were finite" in line
    )


def test_counts_summed_on_the_device_fail_the_step_and_say_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Async V1 and V2 add the audit's findings to the counts on the device: the step
    still fails, and the log says the count is NaN logits or non-finite KV."""
    s = _audited()
    s.add_request(make_request("a", list(range(100, 100 + BLOCK)), max_tokens=2))
    so = s.schedule()
    with caplog.at_level(logging.WARNING, logger="vllm.kvguard"):
        reasons = finish_reasons(s.update_from_output(so, model_output(s, so, {"a": 1})))
    assert reasons == {"a": "error"}
    assert s.kvguard_stats()["requests_failed_audit"] == 0  # not told apart
    (line,) = [r.getMessage() for r in caplog.records if "aborted request" in r.getMessage()]
    assert "had 1 NaN logit(s) or non-finite KV block(s) (KV audit);" in line
