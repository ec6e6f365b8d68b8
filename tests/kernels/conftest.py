"""Shared fixtures for the kernel tests.

Kernels run on CPU tensors through the Triton interpreter. ``triton.jit`` reads
``TRITON_INTERPRET`` when it *decorates* a kernel, i.e. when ``kvguard.kernels`` is first
imported, so the variable is set here, before any test module imports the package.

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

os.environ["TRITON_INTERPRET"] = "1"

if importlib.util.find_spec("torch") is None:  # the core suite runs without torch
    collect_ignore_glob = ["test_*.py"]
