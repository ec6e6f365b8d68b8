"""Which implementation a launcher runs: the Triton kernel or the pure-torch reference.

Triton is optional (torchao's pattern): without it every launcher still works through its
``*_ref`` function. The choice is explicit and testable through ``backend=``:

* ``"triton"`` — the Triton kernel; an error if it cannot run on these tensors.
* ``"torch"`` — the pure-torch reference (also the test oracle).
* ``"auto"`` — Triton when it can run (CUDA tensors, or CPU tensors under the Triton
  interpreter), else torch.

The interpreter is chosen by ``TRITON_INTERPRET=1`` **before** ``kvguard.kernels`` is
imported: ``triton.jit`` reads the variable when it decorates a kernel, so setting it later
leaves compiled kernels that cannot take CPU tensors.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

from kvguard.errors import KvGuardError

try:  # optional dependency: the torch references need nothing but torch
    import triton
    import triton.language as tl
    from triton import knobs as _knobs

    HAS_TRITON = True
    INTERPRET: bool = bool(_knobs.runtime.interpret)
    """True when kernels defined now are run by the Triton interpreter (CPU tensors)."""
except ImportError:  # pragma: no cover - exercised in a subprocess test
    triton = None
    tl = None
    HAS_TRITON = False
    INTERPRET = False

Backend = Literal["auto", "triton", "torch"]

# CUDA caps grid dimension 0 at 2**31 - 1 programs; launchers never ask for more than this
# and loop (grid-stride) over the remaining work instead.
MAX_GRID = 2**31 - 1

__all__ = [
    "HAS_TRITON",
    "INTERPRET",
    "MAX_GRID",
    "Backend",
    "BackendUnavailableError",
    "default_max_programs",
    "launch_grid",
    "resolve_backend",
    "tl",
    "triton",
]


class BackendUnavailableError(KvGuardError, RuntimeError):
    """``backend="triton"`` was asked for tensors Triton cannot run on here."""


def triton_can_run(device: torch.device) -> bool:
    """Whether our Triton kernels can take tensors on ``device`` in this process."""
    if not HAS_TRITON:
        return False
    if INTERPRET:
        return device.type == "cpu"
    return device.type == "cuda"


def resolve_backend(backend: Backend, device: torch.device) -> Literal["triton", "torch"]:
    """Turn ``backend`` into the implementation that will run on ``device``."""
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if triton_can_run(device) else "torch"
    if backend == "triton":
        if triton_can_run(device):
            return "triton"
        if not HAS_TRITON:
            why = "triton is not installed"
        elif device.type == "cpu":
            why = (
                "CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before "
                "importing kvguard.kernels"
            )
        else:
            why = f"Triton kernels here run on {'cpu' if INTERPRET else 'cuda'} tensors only"
        raise BackendUnavailableError(f"backend='triton' cannot run on {device}: {why}")
    raise ValueError(f"backend must be 'auto', 'triton' or 'torch', not {backend!r}")


@functools.cache
def _cuda_programs(index: int) -> int:
    # 16 resident programs per SM keeps every SM busy while each program loops
    # (grid-stride) over its share; more programs only add scheduling overhead.
    return int(torch.cuda.get_device_properties(index).multi_processor_count) * 16


def default_max_programs(device: torch.device) -> int:
    """How many programs a launch uses at most on ``device`` (work beyond loops)."""
    if device.type == "cuda":
        return _cuda_programs(device.index if device.index is not None else 0)
    # The interpreter runs programs one after another: a few programs that loop cost the
    # same as many programs, minus the per-program setup.
    return 4


def launch_grid(num_items: int, max_programs: int) -> tuple[int]:
    """A 1-D grid for ``num_items`` work items: never empty, never above the CUDA limit.

    Kernels walk ``range(program_id, num_items, num_programs)``, so any grid size is
    correct; this only bounds it.
    """
    if max_programs < 1:
        raise ValueError(f"max_programs must be >= 1, got {max_programs}")
    return (max(1, min(num_items, max_programs, MAX_GRID)),)
