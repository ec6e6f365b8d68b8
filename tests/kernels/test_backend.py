"""Optional Triton: the torch path without triton, and the kernels compile for a GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

import torch

from kvguard.kernels import BackendUnavailableError, resolve_backend
from kvguard.kernels.backend import HAS_TRITON

from .cases import interpreter_only


def _run(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=240,
    )


def test_without_triton_everything_runs_the_torch_reference() -> None:
    proc = _run(
        """
        import sys
        sys.modules["triton"] = None  # import triton now raises ImportError
        import torch
        import kvguard.kernels as k
        assert not k.HAS_TRITON
        caches = [torch.ones(4, 2, 3, 2, 2)]
        layout = k.KVCacheLayout(caches, k.LayoutKind.FLASHINFER)
        k.zero_blocks(layout, [1])
        assert not caches[0][1].any() and caches[0][2].all()
        assert k.zero_slots(layout, torch.tensor([9])) == 1
        assert k.audit_blocks(layout, [0]).tolist() == [False]
        logits = torch.full((2, 5), float("nan"))
        assert k.count_nonfinite_per_request(logits, torch.tensor([0, 2])).tolist() == [10]
        try:
            k.zero_blocks(layout, [1], backend="triton")
        except k.BackendUnavailableError as e:
            assert "not installed" in str(e)
        else:
            raise AssertionError("backend='triton' without triton must raise")
        print("OK")
        """
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_triton_on_cpu_without_the_interpreter_is_refused() -> None:
    proc = _run(
        """
        import torch, kvguard.kernels as k
        assert k.resolve_backend("auto", torch.device("cpu")) == "torch"
        try:
            k.resolve_backend("triton", torch.device("cpu"))
        except k.BackendUnavailableError as e:
            # What to do: set the interpreter on, or install triton first.
            assert ("TRITON_INTERPRET=1" if k.HAS_TRITON else "not installed") in str(e), e
        else:
            raise AssertionError("backend='triton' on CPU without the interpreter must raise")
        print("OK")
        """
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


@interpreter_only
def test_interpreter_mode_refuses_cuda_tensors() -> None:
    with pytest.raises(BackendUnavailableError, match="cpu tensors only"):
        resolve_backend("triton", torch.device("cuda"))


COMPILE = """
import importlib
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

mods = {m: importlib.import_module("kvguard.kernels." + m)
        for m in ("zero_blocks", "zero_slots", "count_nonfinite", "audit_blocks")}
I64, I32 = "i64", "i32"
region = {"size0": I32, "size1": I32, "size2": I32, "stride0": I64, "stride1": I32,
          "stride2": I32, "inner": I32, "num_chunks": I32}
cases = [
    (mods["zero_blocks"]._zero_blocks_kernel,
     {"table_ptr": "*i64", "ids_ptr": "*i64", "num_items": I64, "num_layers": I32,
      "block_stride": I64, **region, "WORD": "constexpr", "BLOCK": "constexpr",
      "EVICTION": "constexpr"},
     {"WORD": tl.int64, "BLOCK": 1024, "EVICTION": ""}),
    (mods["zero_slots"]._zero_slots_kernel,
     {"table_ptr": "*i64", "slots_ptr": "*i64", "num_items": I32, "num_layers": I32,
      "block_size": I32, "block_stride": I64, "token_stride": I32, **region,
      "WORD": "constexpr", "BLOCK": "constexpr"},
     {"WORD": tl.int8, "BLOCK": 32}),
    (mods["count_nonfinite"]._count_nonfinite_kernel,
     {"bits_ptr": "*i16", "cu_rows_ptr": "*i32", "out_ptr": "*i32", "num_items": I64,
      "num_splits": I64, "cols_per_split": I64, "num_rows": I32, "vocab": I32,
      "row_stride": I64, "col_stride": I32,
      "EXP_MASK": "constexpr", "MANT_MASK": "constexpr", "NAN_ONLY": "constexpr",
      "BLOCK": "constexpr"},
     {"EXP_MASK": 0x7F80, "MANT_MASK": 0x7F, "NAN_ONLY": True, "BLOCK": 4096}),
    (mods["audit_blocks"]._audit_blocks_kernel,
     {"table_ptr": "*i64", "ids_ptr": "*i64", "flags_ptr": "*i32", "num_items": I64,
      "num_layers": I32, "block_stride": I64, **region, "BITS": "constexpr",
      "EXP_MASK": "constexpr", "BLOCK": "constexpr"},
     {"BITS": tl.int32, "EXP_MASK": 0x7F800000, "BLOCK": 2048}),
]
for fn, sig, consts in cases:
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                              target=GPUTarget("cuda", 90, 32))
    assert ".entry" in compiled.asm["ptx"]
print("OK")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernels_compile_for_sm90() -> None:
    """No GPU in CI: compile (not run) every kernel for an H100/H200 to catch code the
    interpreter accepts but the compiler does not."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists() and shutil.which("ptxas") is None:
        pytest.skip("no ptxas to compile with")
    proc = _run(
        COMPILE,
        TRITON_DEFAULT_FP_FUSION="1",
        TRITON_CACHE_DIR=str(Path(os.environ.get("TMPDIR", "/tmp")) / "kvguard-triton-cache"),
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
