"""Undoing what kvguard's vLLM plugin patches in this process, for tests that activate
it: the scheduler-level suite (tests/vllm) and the real-engine suite (tests/e2e) both
use these. Needs vLLM; imported by the tests that call it."""

from __future__ import annotations

import pytest


def undo_plugin_patches_after(monkeypatch: pytest.MonkeyPatch) -> None:
    """What kvguard's plugin patches in vLLM (zeroing, the scheduler class, the
    connector factory, the fault handler, the model runners) is put back when
    ``monkeypatch`` undoes its changes."""

    from vllm.config.scheduler import SchedulerConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.fault_tolerance.engine_core_sentinel import EngineCoreSentinel
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kvguard.adapters.vllm._compat import zeroing_is_a_field

    if zeroing_is_a_field():
        monkeypatch.setattr(KVCacheConfig, "__post_init__", KVCacheConfig.__post_init__)
    else:
        monkeypatch.setattr(
            KVCacheConfig,
            "needs_kv_cache_zeroing",
            KVCacheConfig.__dict__["needs_kv_cache_zeroing"],
        )
    monkeypatch.setattr(SchedulerConfig, "get_scheduler_cls", SchedulerConfig.get_scheduler_cls)
    monkeypatch.setattr(
        KVConnectorFactory,
        "get_connector_class",
        KVConnectorFactory.__dict__["get_connector_class"],
    )
    monkeypatch.setattr(KVConnectorFactory, "_registry", dict(KVConnectorFactory._registry))
    monkeypatch.setattr(EngineCoreSentinel, "on_fault", EngineCoreSentinel.on_fault)
    from vllm.v1.engine.core import EngineCore

    # (Added by the plugin: removed again on undo.)
    monkeypatch.setattr(
        EngineCore,
        "kvguard_invalidate_tokens",
        getattr(EngineCore, "kvguard_invalidate_tokens", None),
        raising=False,
    )
    undo_runner_patches_after(monkeypatch)


def undo_runner_patches_after(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model runners' patches -- per-request NaN counting (``worker_nans``), the
    slot wipe (``worker_slots``), the KV audit (``worker_audit``) and the block zeroing
    (``worker_zeroing``) -- are put back when ``monkeypatch`` undoes its changes: V2's
    runner, 0.34's CPU runner and zeroer, and V1's runner where the series has one."""
    import sys

    import vllm.v1.worker.gpu.model_runner as v2_runner

    from kvguard.adapters.vllm._compat import has_v1_model_runner
    from kvguard.adapters.vllm.workers import audit as worker_audit
    from kvguard.adapters.vllm.workers import nans as worker_nans
    from kvguard.adapters.vllm.workers import slots as worker_slots
    from kvguard.adapters.vllm.workers import zeroing as worker_zeroing

    monkeypatch.setattr(worker_nans.PATCHES, "applied", False)
    monkeypatch.setattr(worker_slots.PATCHES, "applied", False)
    monkeypatch.setattr(worker_audit.PATCHES, "applied", False)
    monkeypatch.setattr(worker_zeroing.PATCHES, "applied", False)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    v2 = v2_runner.GPUModelRunner
    monkeypatch.setattr(v2, "sample", v2.sample)
    monkeypatch.setattr(v2, "update_requests", v2.update_requests)
    zeroer = sys.modules.get(worker_zeroing.CPU_ZEROER_MODULE)  # (0.34's CPU zeroer)
    if zeroer is not None:
        cpu_zeroer = zeroer.CPUKVBlockZeroer
        monkeypatch.setattr(cpu_zeroer, "zero_block_ids", cpu_zeroer.zero_block_ids)
    cpu = sys.modules.get(worker_nans.CPU_RUNNER)  # (0.34's standalone CPU runner)
    if cpu is not None:
        cpu_runner = cpu.StandaloneCPUModelRunner
        monkeypatch.setattr(cpu_runner, "update_requests", cpu_runner.update_requests)
        monkeypatch.setattr(cpu_runner, "sample", cpu_runner.sample)
        monkeypatch.setattr(cpu_runner, "sample_tokens", cpu_runner.sample_tokens)
    if has_v1_model_runner():
        import vllm.v1.worker.gpu_model_runner as v1_runner

        monkeypatch.setattr(v1_runner, "count_nans_per_row", v1_runner.count_nans_per_row)
        runner = v1_runner.GPUModelRunner
        monkeypatch.setattr(runner, "_update_states", runner._update_states)
        monkeypatch.setattr(runner, "_bookkeeping_sync", runner._bookkeeping_sync)
        monkeypatch.setattr(runner, "_get_nans_in_logits", runner._get_nans_in_logits)
