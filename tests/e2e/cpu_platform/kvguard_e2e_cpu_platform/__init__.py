"""Test-only vLLM platform plugin: vLLM 0.34's real engine on a CPU machine.

vLLM's CPU build stops at 0.32 on PyPI and 0.34's CPU backend does not build here, so the
e2e venv of 0.34 holds the CUDA wheel, whose compiled ``torch.ops._C`` ops are absent on
a CPU machine. :class:`~kvguard_e2e_cpu_platform.platform.TorchCpuPlatform` is vLLM's
CPU platform with pure-torch versions of the ops a dense model needs (registered by
:mod:`~kvguard_e2e_cpu_platform.library`) and vLLM's no-Triton CPU model runner.

vLLM calls :func:`register` of every ``vllm.platform_plugins`` entry point while it
resolves the platform, in every process it starts. It stays inactive unless
``KVGUARD_E2E_CPU_PLATFORM=1`` is set, so that installing it changes nothing by itself;
``VLLM_TARGET_DEVICE`` must stay unset (vLLM then skips plugin discovery).
"""

from __future__ import annotations

import os

ENV = "KVGUARD_E2E_CPU_PLATFORM"
PLATFORM = "kvguard_e2e_cpu_platform.platform.TorchCpuPlatform"


def register() -> str | None:
    """The platform class's dotted path while ``KVGUARD_E2E_CPU_PLATFORM=1``, else None.

    Imports nothing of vLLM: it runs while ``vllm.platforms`` is still resolving."""
    return PLATFORM if os.environ.get(ENV) == "1" else None
