"""Seals (``{"kvguard": {"seal": true}}``): the scheduler sends each step's filled blocks,
the workers seal exactly those (``seal_blocks`` over every attention cache, under the
runner's salt) and the seals ride back on the step's NaN counts; the pool records each
block's seal when its step validates, and its copies carry it.

Worker side on caches with sentinel values (vLLM's real runner classes patched, their
step stood in for); scheduler side on vLLM's real scheduler. The real-engine test is
tests/e2e/test_seals.py."""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")


from kvguard.adapters.vllm.config import GuardConfigError  # noqa: E402
from kvguard.adapters.vllm.pool.block_pool import GuardModeUnsupported  # noqa: E402
from kvguard.adapters.vllm.workers import caches as worker_caches  # noqa: E402
from kvguard.adapters.vllm.workers import seals as worker_seals  # noqa: E402
from kvguard.adapters.vllm.workers.audit import AuditedCounts, with_seals  # noqa: E402
from kvguard.kernels import seal_blocks  # noqa: E402

from .conftest import undo_runner_patches_after  # noqa: E402
from .harness import BLOCK, make_request, make_scheduler, model_output  # noqa: E402
from .test_worker_audit import _cache, _runner, _v1, _v2_runner_class  # noqa: E402


def test_a_steps_blocks_are_sealed_over_every_layer_under_the_runners_salt() -> None:
    runner = _runner()
    _cache(runner, 1)[1, 3, 0, 0, 0] = 5.0  # block 3 differs from block 1 in layer 1 only
    seals = worker_seals.seal_step(runner, {"a": [1, 3], "b": [3, 4]})
    assert list(seals) == [1, 3, 4]  # each block once
    (layout,) = worker_caches.block_layouts(runner)
    (salt,) = worker_seals.runner_salt(runner)
    want = seal_blocks(layout, [1, 3, 4], salt=salt).tolist()
    assert list(seals.values()) == want
    assert seals[1] != seals[3]
    # Blocks 1 and 4 hold the same bytes: the same seal (positions, not ids, count).
    assert seals[1] == seals[4]


def test_the_salt_tells_models_and_layouts_apart() -> None:
    one, other = _runner(), _runner()
    other.model_config = SimpleNamespace(model="another-model")
    assert worker_seals.runner_salt(one) != worker_seals.runner_salt(other)
    assert worker_seals.runner_salt(_runner()) == worker_seals.runner_salt(one)
    cpu = _runner("CPU_ATTN")
    assert worker_seals.runner_salt(cpu) != worker_seals.runner_salt(one)


def test_seals_ride_on_the_counts_across_processes() -> None:
    counts = with_seals(AuditedCounts({"a": 0}, {"a": 1}), {7: -3, 9: 2})
    again = pickle.loads(pickle.dumps(counts))
    assert dict(again) == {"a": 1} and again.kv_audit == {"a": 1}
    assert again.seals == {7: -3, 9: 2}
    plain = with_seals({"b": 0}, {1: 1})
    assert dict(plain) == {"b": 0} and plain.kv_audit == {} and plain.seals == {1: 1}


def test_v1_seals_the_blocks_of_a_step_it_reads_back(monkeypatch: pytest.MonkeyPatch) -> None:
    undo_runner_patches_after(monkeypatch)
    cls = _v1()

    def stock(self: Any, scheduler_output: Any, *args: Any) -> tuple[Any, ...]:
        return ({"a": 0}, None, "rest")

    monkeypatch.setattr(cls, "_bookkeeping_sync", stock)
    worker_seals.install()
    worker_seals.install()  # idempotent: one wrapper
    patched = cls._bookkeeping_sync
    assert patched.__wrapped__ is stock
    runner = _runner()
    counts, device, rest = patched(runner, SimpleNamespace(kvguard_blocks_to_seal={"a": [2]}))
    assert (dict(counts), device, rest) == ({"a": 0}, None, "rest")
    assert counts.seals == worker_seals.seal_step(runner, {"a": [2]})
    assert patched(runner, SimpleNamespace()) == ({"a": 0}, None, "rest")  # nothing to seal


def test_cpu_runner_seals_in_sample_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    undo_runner_patches_after(monkeypatch)
    cls = _v2_runner_class("CPU")

    def update_requests(self: Any, scheduler_output: Any) -> None:
        return None

    def sample_tokens(self: Any, grammar_output: Any) -> Any:
        return SimpleNamespace(num_nans_in_logits={"a": 0, "b": 0})

    monkeypatch.setattr(cls, "update_requests", update_requests)
    monkeypatch.setattr(cls, "sample_tokens", sample_tokens)
    worker_seals.install()
    runner = _runner()
    cls.update_requests(runner, SimpleNamespace(kvguard_blocks_to_seal={"a": [1], "b": [5]}))
    counts = cls.sample_tokens(runner, None).num_nans_in_logits
    assert isinstance(counts, AuditedCounts) and dict(counts) == {"a": 0, "b": 0}
    assert counts.seals == worker_seals.seal_step(runner, {"a": [1], "b": [5]})
    cls.update_requests(runner, SimpleNamespace())  # a step without: vLLM's plain counts
    assert type(cls.sample_tokens(runner, None).num_nans_in_logits) is dict


def test_an_unknown_backend_is_refused_not_left_unsealed() -> None:
    with pytest.raises(GuardModeUnsupported, match="SOME_NEW_BACKEND"):
        worker_seals.seal_step(_runner("SOME_NEW_BACKEND"), {"a": [1]})


# ---------------------------------------------------------------- the scheduler


def test_each_step_carries_its_fills_and_validates_them_with_their_seals() -> None:
    prompt = list(range(100, 100 + 4 * BLOCK + 8))  # a chunk of 4 blocks, then 8 tokens
    s = make_scheduler(kvguard={"seal": True})
    s.add_request(make_request("a", prompt, max_tokens=2))
    so = s.schedule()
    (blocks,) = s.kv_cache_manager.get_block_ids("a")
    filled = list(blocks[:4])
    assert so.kvguard_blocks_to_seal == {"a": filled}
    assert getattr(so, "kvguard_blocks_to_audit", None) is None  # (the audit is off)
    out = model_output(s, so)
    out.num_nans_in_logits = with_seals(out.num_nans_in_logits, {b: 100 + b for b in filled})
    s.update_from_output(so, out)
    pool = s.kv_cache_manager.block_pool
    assert [pool.core.block_seal(b) for b in filled] == [100 + b for b in filled]
    assert s.kvguard_stats()["blocks_sealed"] == 4
    # A copy of a sealed block carries its seal.
    ticket = pool.core.begin_store(filled[0], "cpu")
    assert ticket.seal == 100 + filled[0]
    off = make_scheduler()
    off.add_request(make_request("a", prompt, max_tokens=2))
    assert getattr(off.schedule(), "kvguard_blocks_to_seal", None) is None


def test_a_step_that_comes_back_unsealed_validates_its_blocks_unsealed() -> None:
    s = make_scheduler(kvguard={"seal": True})
    s.add_request(make_request("a", list(range(2 * BLOCK + 1)), max_tokens=2))
    so = s.schedule()
    s.update_from_output(so, model_output(s, so))  # plain counts: no seals
    (blocks,) = s.kv_cache_manager.get_block_ids("a")
    pool = s.kv_cache_manager.block_pool
    assert [pool.core.block_seal(b) for b in blocks[:2]] == [None, None]
    assert pool.core.block_state(blocks[0]).name == "PUBLISHED"


def test_seals_are_refused_where_they_cannot_be_taken() -> None:
    with pytest.raises(GuardModeUnsupported, match="synchronous scheduling"):
        make_scheduler(async_scheduling=True, kvguard={"seal": True})
    with pytest.raises(GuardConfigError, match="unknown kvguard settings"):
        make_scheduler(kvguard={"seals": True})


def test_a_load_is_verified_block_by_block_and_refused_without_a_sealing_runner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``unsealed_blocks``, the one check every verified load makes: the blocks whose
    KV does not give the seal their copy carries (or that carry none); every block
    when the process has no sealing runner (a load nothing can verify is refused)."""
    runner = _runner()
    good = worker_seals.seal_step(runner, {"a": [1, 2, 3]})
    monkeypatch.setattr(worker_seals, "_process_runner", [runner])
    assert worker_seals.unsealed_blocks(good) == []
    _cache(runner, 0)[1, 2, 0, 0, 0] = -1.0  # block 2's V in layer 0 rots
    assert worker_seals.unsealed_blocks(good) == [2]
    assert worker_seals.unsealed_blocks({**good, 3: None}) == [2, 3]
    assert worker_seals.unsealed_blocks({}) == []
    monkeypatch.setattr(worker_seals, "_process_runner", [])
    assert worker_seals.unsealed_blocks(good) == [1, 2, 3]
