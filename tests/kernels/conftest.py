"""Shared fixtures for the kernel tests.

By default the kernels run on CPU tensors through the Triton interpreter (CI has no GPU).
``triton.jit`` reads ``TRITON_INTERPRET`` when it *decorates* a kernel, i.e. when
``kvguard.kernels`` is first imported, so the variable is set here, before any test module
imports the package.

``KVGUARD_KERNEL_DEVICE=cuda`` runs the same tests on a GPU instead: compiled kernels, and
every tensor a test makes lands on the GPU (the fixture below makes CUDA the default
device), with the torch reference still the oracle. ``.ci/gpu-check`` runs it that way.

Tolerances: every check in these tests is exact. Zeroing stores zero bits, and NaN/Inf
detection reads bit patterns, so Triton and torch must agree bit for bit in every dtype:

    dtype            zero_blocks / zero_slots   count_nonfinite   audit_blocks
    float32          bit-exact                  exact count       exact flag
    float16          bit-exact                  exact count       exact flag
    bfloat16         bit-exact                  exact count       exact flag
    float8_e4m3fn    bit-exact                  exact count       exact flag
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

KERNEL_DEVICE = os.environ.get("KVGUARD_KERNEL_DEVICE", "cpu")
if KERNEL_DEVICE not in ("cpu", "cuda"):
    raise pytest.UsageError(f"KVGUARD_KERNEL_DEVICE must be cpu or cuda, not {KERNEL_DEVICE!r}")
if KERNEL_DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

if importlib.util.find_spec("torch") is None:  # the core suite runs without torch
    collect_ignore_glob = ["test_*.py"]
else:
    import torch

    @pytest.fixture(autouse=True)
    def _tensors_on_the_kernel_device() -> Iterator[None]:
        """Tensors the tests create land on the device under test."""
        if KERNEL_DEVICE == "cpu":
            yield
            return
        if not torch.cuda.is_available():
            pytest.fail("KVGUARD_KERNEL_DEVICE=cuda but torch sees no CUDA device")
        with torch.device(KERNEL_DEVICE):
            yield
