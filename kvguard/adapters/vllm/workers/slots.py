"""The workers wipe the token slots ``recover()`` rolled back, before the step's forward.

The guarded scheduler sends them with the next step as
``SchedulerOutput.kvguard_slots_to_zero``: kvguard ``SlotRange``s (block, first token,
end) in the scheduler's blocks. :func:`install` (run by kvguard's plugin in every
process vLLM starts) makes the model runners wipe them at the start of the step, where
they zero ``new_block_ids_to_zero``: V1's ``_update_states`` (0.32, 0.33), V2's
``update_requests`` and that of 0.34's standalone CPU runner. Every layer of a cache layout is
wiped in one launch of kvguard's ``zero_slots`` (its torch reference on CPU); the other
tokens of a block -- a partial block's validated prefix -- keep every byte.

Which layout a layer's cache has comes from its attention backend
(:mod:`.worker_caches`); vLLM's CPU attention caches are rewritten, not wiped. A step
carrying slots for a layer whose backend kvguard does not know raises
:class:`~kvguard.adapters.vllm.pool.block_pool.GuardModeUnsupported` rather than leaving the
slots as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from kvguard.adapters.vllm.workers.caches import slot_layouts
from kvguard.adapters.vllm.workers.nans import CPU_RUNNER, V1_RUNNER, V2_RUNNER
from kvguard.adapters.vllm.workers.runner_hooks import RunnerPatches, mark_wrapper
from kvguard.results import SlotRange

SLOTS_FIELD = "kvguard_slots_to_zero"
"""The ``SchedulerOutput`` attribute the guarded scheduler puts the slots in."""

_MARK = "_kvguard_wipes_slots"


def slot_ids(slots: Sequence[SlotRange], block_size: int) -> list[int]:
    """Token slot ids ``block * block_size + offset`` (the scheduler's block size: a
    cache whose kernel blocks are smaller addresses the same token at the same id)."""
    return [s.block_id * block_size + t for s in slots for t in range(s.start, s.end)]


def wipe_slots(runner: Any, slots: Sequence[SlotRange]) -> int:
    """Zero ``slots`` in every attention layer of ``runner``; the slots wiped per layout."""
    import torch

    from kvguard.kernels import zero_slots

    ids = slot_ids(slots, runner.cache_config.block_size)
    wiped = 0
    for layout in slot_layouts(runner):
        tensor = torch.tensor(ids, dtype=torch.int64, device=layout.device)
        wiped += zero_slots(layout, tensor)
    return wiped


def _wiping_first(stock: Callable[..., Any]) -> Callable[..., Any]:
    def step_start(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        slots = getattr(scheduler_output, SLOTS_FIELD, None)
        if slots:
            wipe_slots(self, slots)
        return stock(self, scheduler_output, *args, **kwargs)

    return mark_wrapper(step_start, stock, _MARK)


def _patch(cls: str, method: str) -> Callable[[ModuleType], None]:
    def patch(module: ModuleType) -> None:
        runner = getattr(module, cls)
        stock = getattr(runner, method)
        if not getattr(stock, _MARK, False):
            setattr(runner, method, _wiping_first(stock))

    return patch


PATCHES = RunnerPatches(
    {
        V1_RUNNER: _patch("GPUModelRunner", "_update_states"),
        V2_RUNNER: _patch("GPUModelRunner", "update_requests"),
        CPU_RUNNER: _patch("StandaloneCPUModelRunner", "update_requests"),
    }
)


def install() -> None:
    """Make vLLM's model runners wipe ``kvguard_slots_to_zero`` (see the module doc):
    at once for a runner module already imported, else when it is. Idempotent."""
    PATCHES.install()


def installed() -> bool:
    """Whether :func:`install` ran in this process."""
    return PATCHES.applied
