"""Cache builders and byte comparisons shared by the kernel tests (needs torch)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest
import torch

from kvguard.kernels import KVCacheLayout, LayoutKind

# Where the tests' tensors live (see conftest.py): the CPU under the Triton interpreter,
# or a GPU with compiled kernels.
ON_GPU = os.environ.get("KVGUARD_KERNEL_DEVICE", "cpu") == "cuda"
interpreter_only = pytest.mark.skipif(ON_GPU, reason="checks the Triton interpreter's CPU path")


def seeded(seed: int) -> torch.Generator:
    """A CPU generator: tests draw on the CPU (the same numbers on every device) and move
    the result with ``on_device``."""
    return torch.Generator(device="cpu").manual_seed(seed)


def on_device(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.get_default_device())


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


def random_bytes(shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor whose every byte is random (NaN/Inf bit patterns included): a sentinel
    in which any stray write shows up as a changed byte."""
    numel = 1
    for s in shape:
        numel *= s
    raw = torch.randint(
        0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=seeded(seed), device="cpu"
    )
    return on_device(raw.view(dtype).reshape(tuple(shape)))


def finite(shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    return on_device(torch.randn(tuple(shape), generator=seeded(seed), device="cpu").to(dtype))


def logical_shape(kind: LayoutKind, n: int, b: int, h: int, d: int) -> tuple[int, ...]:
    if kind is LayoutKind.FLASH_ATTN:
        return (2, n, b, h, d)
    if kind is LayoutKind.FLASHINFER:
        return (n, 2, b, h, d)
    return (n, b, h * d)


STRIDINGS = ["dense", "padded", "hnd", "every_other_block"]


def build_cache(
    kind: LayoutKind,
    dtype: torch.dtype,
    *,
    num_layers: int = 2,
    num_blocks: int = 5,
    block_size: int = 3,
    heads: int = 2,
    head_dim: int = 5,
    striding: str = "dense",
    fill: str = "bytes",
    seed: int = 0,
) -> tuple[list[torch.Tensor], KVCacheLayout]:
    """Per-layer backing allocations and a layout over (possibly strided) views.

    Tests compare the *backing* allocations byte for byte, so padding and skipped
    blocks that no view shows are checked to stay untouched as well.
    """
    n, b, h, d = num_blocks, block_size, heads, head_dim
    make = random_bytes if fill == "bytes" else finite
    bases: list[torch.Tensor] = []
    views: list[torch.Tensor] = []
    for layer in range(num_layers):
        s = seed * 1000 + layer
        if striding == "dense":
            base = make(logical_shape(kind, n, b, h, d), dtype, s)
            view = base
        elif striding == "padded":  # head_dim padded to d + 3 (last dim still stride 1)
            base = make(logical_shape(kind, n, b, h, d + 3), dtype, s)
            view = base[..., :d] if kind is not LayoutKind.MLA else base[..., : h * d]
        elif striding == "every_other_block":  # blocks interleaved with foreign ones
            base = make(logical_shape(kind, 2 * n, b, h, d), dtype, s)
            view = base.narrow(kind.block_dim, 0, 2 * n)
            view = view[:, ::2] if kind is LayoutKind.FLASH_ATTN else view[::2]
        elif striding == "hnd":  # heads outside tokens physically (vLLM's HND)
            assert kind is not LayoutKind.MLA
            phys = list(logical_shape(kind, n, b, h, d))
            phys[-3], phys[-2] = phys[-2], phys[-3]
            base = make(phys, dtype, s)
            view = base.transpose(-3, -2)
        else:
            raise AssertionError(striding)
        bases.append(base)
        views.append(view)
    return bases, KVCacheLayout(views, kind, block_size=b)


def raw_bytes(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Byte copies of whole (contiguous) backing allocations."""
    return [t.contiguous().view(torch.uint8).clone() for t in tensors]


def assert_same_bytes(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        xb, yb = x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)
        if not torch.equal(xb, yb):
            diff = (xb != yb).nonzero().flatten()
            raise AssertionError(
                f"layer {i}: {diff.numel()} bytes differ, first at byte offsets {diff[:8].tolist()}"
            )


ALL_KINDS = pytest.mark.parametrize("kind", list(LayoutKind), ids=lambda k: k.name)
ALL_DTYPES = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
