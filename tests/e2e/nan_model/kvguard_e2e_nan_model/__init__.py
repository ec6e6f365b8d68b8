"""Test-only vLLM plugin: registers the fault-injecting models of
:mod:`kvguard_e2e_nan_model.model` -- :class:`~kvguard_e2e_nan_model.model.NanLlamaForCausalLM`
(``ARCHITECTURE``) and the hybrid ones (``GDN_ARCHITECTURE``: gated-delta-net + attention,
``MAMBA2_ARCHITECTURE``: Mamba2 + attention).

vLLM runs :func:`register` in every process it starts (``vllm.general_plugins``), so
the engine core and the workers of the multiprocess engine, and ``vllm serve``'s
processes, all know the architectures. Choose one with ``hf_overrides={"architectures":
[ARCHITECTURE]}`` (or a model directory whose config names it) on a model directory of
the matching transformers model (Llama; Qwen3-Next; GraniteMoeHybrid).

With ``KVGUARD_E2E_ASYNC_SCHEDULING=1`` in the environment of the process that builds
an engine's config, vLLM's CPU platform keeps async scheduling on (see
:func:`allow_async_scheduling_on_cpu`).
"""

from __future__ import annotations

import os
from typing import Any

ARCHITECTURE = "NanLlamaForCausalLM"
GDN_ARCHITECTURE = "NanQwen3NextForCausalLM"
MAMBA2_ARCHITECTURE = "NanGraniteMoeHybridForCausalLM"
ARCHITECTURES = (ARCHITECTURE, GDN_ARCHITECTURE, MAMBA2_ARCHITECTURE)
ASYNC_ENV = "KVGUARD_E2E_ASYNC_SCHEDULING"


def register() -> None:
    from vllm import ModelRegistry

    supported = ModelRegistry.get_supported_archs()
    for name in ARCHITECTURES:
        if name not in supported:
            # By "module:class": vLLM imports the model module when it is needed.
            ModelRegistry.register_model(name, "kvguard_e2e_nan_model.model:" + name)
    allow_async_scheduling_on_cpu()


def allow_async_scheduling_on_cpu() -> None:
    """vLLM's CPU platform sets ``scheduler_config.async_scheduling = False`` in
    ``check_and_update_config`` whatever was asked for ("not required on CPU"); put
    back ``async_scheduling=True`` while ``KVGUARD_E2E_ASYNC_SCHEDULING=1`` is set
    (read at each config check: engines built without it are vLLM's own). vLLM's
    CPU model runner then runs with one step in flight, the engine core's batch
    queue of two; tests only. Idempotent."""
    from vllm.platforms.cpu import CpuPlatform

    stock = CpuPlatform.check_and_update_config
    if getattr(stock, "_kvguard_e2e", False):
        return

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        scheduler_config = vllm_config.scheduler_config
        asked = scheduler_config.async_scheduling
        stock(vllm_config)
        if asked and os.environ.get(ASYNC_ENV) == "1":
            scheduler_config.async_scheduling = True

    check_and_update_config._kvguard_e2e = True  # type: ignore[attr-defined]
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
