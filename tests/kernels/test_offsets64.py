"""int64 offset regression: address math must not wrap at 2**31.

A real 8 GiB cache is not needed: each kernel gets a layer base address shifted *down* by
``block * block_stride`` words, with a stride above 2**31, so that only exact 64-bit math
lands on the small buffer. 32-bit math would write or read elsewhere (likely a segfault,
or an illegal memory access on a GPU), hence a subprocess. It runs on the device the
kernel tests run on (``KVGUARD_KERNEL_DEVICE``, see conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import os
    DEV = os.environ.get("KVGUARD_KERNEL_DEVICE", "cpu")
    if DEV == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    import importlib
    import torch
    from kvguard.kernels.layout import Region
    torch.set_default_device(DEV)

    zb = importlib.import_module("kvguard.kernels.zero_blocks")
    zs = importlib.import_module("kvguard.kernels.zero_slots")
    ab = importlib.import_module("kvguard.kernels.audit_blocks")

    STRIDE = 2**31 + 5   # words per block: block 3 starts ~6.4e9 words past the base
    BLOCK = 3
    run = Region(outer=((1, 0),) * 3, inner=8)

    def table(buf, word_offset, word_bytes):
        addr = buf.data_ptr() + word_offset * word_bytes - BLOCK * STRIDE * word_bytes
        return torch.tensor([addr], dtype=torch.int64)

    buf = torch.full((64,), 7, dtype=torch.int64)
    zb._launch_zero_blocks(table(buf, 16, 8), torch.tensor([BLOCK]), run, STRIDE, 8, 2)
    want = torch.full((64,), 7, dtype=torch.int64)
    want[16:24] = 0
    assert torch.equal(buf, want), buf.tolist()

    # zero_slots: slot = block * block_size + token, token stride 8 words.
    buf = torch.full((64,), 7, dtype=torch.int64)
    slot = torch.tensor([BLOCK * 4 + 2])
    zs._launch_zero_slots(table(buf, 16, 8), slot, run, 4, STRIDE, 8, 8, 2)
    want = torch.full((64,), 7, dtype=torch.int64)
    want[32:40] = 0
    assert torch.equal(buf, want), buf.tolist()

    # audit: the NaN sits inside the block only exact math reaches.
    vals = torch.zeros(64, dtype=torch.float32)
    vals[21] = float("nan")
    for start, expect in ((16, 1), (40, 0)):
        flags = torch.zeros(1, dtype=torch.int32)
        ab._launch_audit_blocks(table(vals, start, 4), torch.tensor([BLOCK]), flags, run,
                                STRIDE, torch.float32, 2)
        assert flags.tolist() == [expect], (start, flags.tolist())
    print("OK")
    """
)


def test_offsets_are_64_bit() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, (
        f"rc={proc.returncode} (negative = killed by a signal: wrapped 32-bit offsets)\n"
        f"{proc.stdout}\n{proc.stderr[-3000:]}"
    )
