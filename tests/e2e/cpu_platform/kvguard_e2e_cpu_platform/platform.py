"""vLLM's CPU platform running on pure-torch ops (see the package's docstring)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from vllm.platforms.cpu import CpuPlatform

from .library import register_ops


@contextlib.contextmanager
def _triton_check_passed() -> Iterator[None]:
    """``CpuPlatform.check_and_update_config`` refuses x86 without Triton ("vLLM on
    x86 CPUs requires Triton (triton-cpu)"), read from ``vllm.triton_utils.HAS_TRITON``
    when it runs: that reads True for the call. Triton's only use on the CPU is vLLM's
    Triton model runner, which this platform replaces with the standalone one."""
    import vllm.triton_utils

    saved = vllm.triton_utils.HAS_TRITON
    vllm.triton_utils.HAS_TRITON = True
    try:
        yield
    finally:
        vllm.triton_utils.HAS_TRITON = saved


class TorchCpuPlatform(CpuPlatform):  # type: ignore[misc]  # (vLLM is untyped: Any)
    @classmethod
    def import_kernels(cls) -> None:
        # vLLM's compiled CPU ops are not in the CUDA wheel (its _C is CUDA-only).
        register_ops()

    @classmethod
    def uses_standalone_cpu_model_runner(cls) -> bool:
        # vLLM's no-Triton runner (vllm/v1/worker/cpu/standalone_model_runner.py),
        # otherwise for non-x86 CPUs only: its batch preparation and sampling are the
        # ops of block_table, input_batch, gumbel and logit_bias.
        return True

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        with _triton_check_passed():
            super().check_and_update_config(vllm_config)
        # vLLM's custom ops (RMSNorm, rotary embedding, SiLU-and-mul, ...) call compiled
        # kernels on the CPU; "none" makes them take their native torch forward. vLLM
        # chose "all" (eager) before this check; one asked for by name ("+rms_norm")
        # still fails, loudly, at its first call.
        custom_ops = vllm_config.compilation_config.custom_ops
        custom_ops[:] = ["none" if name == "all" else name for name in custom_ops]
