"""The guarded schedulers: vLLM's ``Scheduler`` and ``AsyncScheduler`` with kvguard's
validation gate, one file per concern: start-up and refusals (:mod:`.startup`), each
step's verdict and the classes composing the concerns (:mod:`.guarded`), window frees
(:mod:`.windows`), fault recovery (:mod:`.recovery`), invalidation
(:mod:`.invalidation`), the counters (:mod:`.stats`); the record of each step in
flight (:mod:`.step_ledger`).

``kvguard.adapters.vllm.scheduler.GuardedScheduler`` is the name to give vLLM
(``--scheduler-cls``); importing this package alone does not import vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvguard.adapters.vllm.scheduler.guarded import GuardedAsyncScheduler, GuardedScheduler

__all__ = ["GuardedAsyncScheduler", "GuardedScheduler"]


def __getattr__(name: str) -> Any:
    # vLLM resolves --scheduler-cls by module and attribute; the classes import vLLM.
    if name in __all__:
        from kvguard.adapters.vllm.scheduler import guarded

        return getattr(guarded, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
