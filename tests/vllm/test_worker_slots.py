"""The workers wipe the slots ``recover()`` sends (``kvguard_slots_to_zero``) before the
step's forward: in every attention layer, exactly those token slots, the rest of each
block untouched; vLLM's real runner classes are patched at the start of the step."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

import torch  # noqa: E402

from kvguard.adapters.vllm._compat import has_v1_model_runner  # noqa: E402
from kvguard.adapters.vllm.pool.block_pool import GuardModeUnsupported  # noqa: E402
from kvguard.adapters.vllm.workers import nans as worker_nans  # noqa: E402
from kvguard.adapters.vllm.workers import slots as worker_slots  # noqa: E402
from kvguard.results import SlotRange  # noqa: E402

from .conftest import undo_runner_patches_after  # noqa: E402

BLOCKS, HEADS, SIZE, DIM = 6, 2, 4, 3


def _runner(backend: str = "FLASH_ATTN", layers: int = 2) -> Any:
    """What wipe_slots reads of a model runner: its attention groups, the layers'
    caches (vLLM's FlashAttention layout, [2, blocks, block_size, heads, head_dim],
    sentinel-filled) and the scheduler's block size."""
    context = {
        f"layer{i}": SimpleNamespace(kv_cache=torch.full((2, BLOCKS, SIZE, HEADS, DIM), 7.0 + i))
        for i in range(layers)
    }
    group = SimpleNamespace(
        backend=SimpleNamespace(get_name=lambda: backend), layer_names=list(context)
    )
    return SimpleNamespace(
        attn_groups=[[group]],
        compilation_config=SimpleNamespace(static_forward_context=context),
        cache_config=SimpleNamespace(block_size=SIZE),
    )


def _caches(runner: Any) -> list[torch.Tensor]:
    return [layer.kv_cache for layer in runner.compilation_config.static_forward_context.values()]


def test_exactly_the_slots_are_wiped_in_every_layer() -> None:
    runner = _runner()
    before = [c.clone() for c in _caches(runner)]
    slots = [SlotRange(2, 1, SIZE), SlotRange(4, 0, SIZE)]
    assert worker_slots.wipe_slots(runner, slots) == 3 + 4
    for old, new in zip(before, _caches(runner), strict=True):
        want = old.clone()
        want[:, 2, 1:] = 0  # block 2 keeps its first token (its validated prefix)
        want[:, 4] = 0
        assert torch.equal(new, want)


def test_cpu_attention_caches_are_rewritten_not_wiped() -> None:
    """vLLM's CPU attention packs K and V per ISA: its caches are left as they are (the
    resumed step rewrites the rolled-back slots before any query reads them)."""
    runner = _runner(backend="CPU_ATTN")
    before = [c.clone() for c in _caches(runner)]
    assert worker_slots.wipe_slots(runner, [SlotRange(2, 1, SIZE)]) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, _caches(runner), strict=True))


def test_an_unknown_backend_is_refused_not_skipped() -> None:
    runner = _runner(backend="SOME_NEW_BACKEND")
    before = [c.clone() for c in _caches(runner)]
    with pytest.raises(GuardModeUnsupported, match="attention backend SOME_NEW_BACKEND"):
        worker_slots.wipe_slots(runner, [SlotRange(1, 0, SIZE)])
    assert all(torch.equal(a, b) for a, b in zip(before, _caches(runner), strict=True))


def _runner_class(which: str) -> tuple[Any, str]:
    if which == "V1":
        if not has_v1_model_runner():
            pytest.skip("vLLM 0.34 has no V1 model runner")
        import vllm.v1.worker.gpu_model_runner as v1

        return v1.GPUModelRunner, "_update_states"
    if which == "V2":
        import vllm.v1.worker.gpu.model_runner as v2

        return v2.GPUModelRunner, "update_requests"
    cpu = pytest.importorskip(
        worker_nans.CPU_RUNNER, reason="vLLM's standalone CPU runner comes with 0.34"
    )
    return cpu.StandaloneCPUModelRunner, "update_requests"


@pytest.mark.parametrize("which", ["V1", "V2", "CPU"])
def test_the_runner_wipes_before_its_step_runs(which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    undo_runner_patches_after(monkeypatch)
    cls, method = _runner_class(which)
    seen: list[list[torch.Tensor]] = []

    def stock(self: Any, scheduler_output: Any) -> str:
        seen.append([c.clone() for c in _caches(self)])  # what the step starts from
        return "stepped"

    monkeypatch.setattr(cls, method, stock)
    worker_slots.install()
    worker_slots.install()  # idempotent: one wrapper
    patched = getattr(cls, method)
    assert patched.__wrapped__ is stock
    runner = _runner()
    out = SimpleNamespace(kvguard_slots_to_zero=[SlotRange(3, 2, SIZE)])
    assert patched(runner, out) == "stepped"
    block = seen[0][0][:, 3]
    assert not block[:, 2:].any() and block[:, :2].eq(7.0).all()
    plain = _runner()
    assert patched(plain, SimpleNamespace()) == "stepped"  # no slots: vLLM's step only
    assert seen[1][0].eq(7.0).all()
    assert worker_slots.installed()
