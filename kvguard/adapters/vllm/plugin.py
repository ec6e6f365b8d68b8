"""vLLM plugin (``vllm.general_plugins`` entry point ``kvguard``): the guard with no code change.

vLLM runs :func:`register` in every process it starts (API server, engine core, each
worker). The guard is asked for by ``--additional-config '{"kvguard": {...}}'`` (the
config reaches every process; ``"enabled": false`` switches it off) or, where that
has no ``kvguard`` entry, by ``KVGUARD_GUARD=1`` in the environment. :func:`register`
itself changes nothing but four start-up hooks, which read the config each process is
given (the plugin loads before any config is in reach):

* a worker, as it is built (``WorkerBase.__init__``), and the engine core, before it
  sizes the KV cache (``EngineCore._initialize_kv_caches``), switch the guard on in
  their process when the config (or the environment) asks for it -- :func:`activate`;
* the engine core then asks every worker (``collective_rpc("kvguard_report")``) whether
  it counts NaN logits per request and built its block zeroer, and refuses to start
  (:class:`GuardConfigError`, naming the worker and what is missing) when one does not
  -- a worker where the plugin did not run, or ran without the config;
* the front end takes kvguard's counters out of the ``SchedulerStats`` each engine
  sends (:mod:`kvguard.adapters.vllm.metrics`) and serves them on ``/metrics``.

:func:`activate`, in one process:

* refuses an unsupported vLLM with :class:`UnsupportedVllmError` (clear message);
* turns vLLM's per-request NaN counting on (``VLLM_COMPUTE_NANS_IN_LOGITS=1``, inherited
  by workers started later), or refuses if it was switched off explicitly;
* makes ``KVCacheConfig.needs_kv_cache_zeroing`` true -- the one place vLLM decides it,
  read by the scheduler *and* by each worker, which builds its block zeroer only then.
  Without it the V1 model runner silently skips ``new_block_ids_to_zero`` (V2 asserts),
  and quarantined blocks would be reused unwiped. The guarded scheduler keeps vLLM from
  zeroing *every* new block in return (only kvguard's zero queue is sent), unless the
  model needs vLLM's own zeroing (Mamba, mixed-precision caches);
* selects the guarded scheduler when none was chosen (``--scheduler-cls`` unset):
  ``GuardedAsyncScheduler`` with async scheduling, else ``GuardedScheduler``;
* registers kvguard's gated connectors (:data:`.exits.coverage.GATED`) with vLLM's
  connector factory and gives them to ``kv_connector="OffloadingConnector"``,
  ``"SimpleCPUOffloadConnector"``, ``"ExampleConnector"`` and ``"LMCacheConnectorV1"``,
  also as a ``MultiConnector``'s children (subclasses: their stores cover validated
  blocks only, see :mod:`kvguard.adapters.vllm.exits`);
* makes vLLM's model runners count NaN logits per request rather than per logits row,
  which is what lets the guard validate steps under speculative decoding (see
  :mod:`kvguard.adapters.vllm.workers.nans`; applied when a runner's module is imported).

Idempotent: vLLM may load plugins several times per process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kvguard.adapters.vllm import metrics
from kvguard.adapters.vllm._compat import (
    require_supported_vllm,
    zeroing_is_a_field,
)
from kvguard.adapters.vllm.config import (
    CONFIG_KEY,
    GUARD_ENV,
    NAN_SETTING,
    STOCK_ZEROING,
    SWITCHED_ON,
    GuardConfigError,
    guard_config,
    is_pooling_model,
    note_activated,
    note_workers_checked,
    requested,
    requested_by,
)
from kvguard.adapters.vllm.exits import handoff
from kvguard.adapters.vllm.exits.coverage import GATED, MODULE_PATH
from kvguard.adapters.vllm.workers import audit as worker_audit
from kvguard.adapters.vllm.workers import nans as worker_nans
from kvguard.adapters.vllm.workers import seals as worker_seals
from kvguard.adapters.vllm.workers import slots as worker_slots
from kvguard.adapters.vllm.workers import zeroing as worker_zeroing

_MARK = "_kvguard_plugin"


_active = False
"""Whether :func:`activate` ran in this process."""


def register() -> None:
    """The ``vllm.general_plugins`` entry point."""
    _install_start_up_hooks()
    metrics.install_front_end()
    if requested():
        activate()


def activate(*, by_config: bool = False) -> None:
    """Put the guard in force in this process (see the module doc). Idempotent."""
    global _active
    require_supported_vllm()
    nan = os.environ.get(NAN_SETTING)
    if nan is None:
        os.environ[NAN_SETTING] = "1"
    elif nan.strip().lower() not in SWITCHED_ON:
        raise GuardConfigError(
            f"{GUARD_ENV}=1 validates each step by vLLM's per-request NaN logit counts, but "
            f"{NAN_SETTING}={nan!r} switches them off; unset it or set it to 1"
        )
    _patch_zeroing()
    _patch_scheduler_cls()
    _patch_connector_cls()
    _patch_fault_handler()
    _patch_engine_core_utility()
    worker_nans.install()
    worker_slots.install()
    worker_audit.install()
    worker_seals.install()
    handoff.install()
    worker_zeroing.install()
    _active = True
    note_activated(by_config=by_config)


# ---------------------------------------------------------------------- start-up hooks


def _install_start_up_hooks() -> None:
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.worker_base import WorkerBase, WorkerWrapperBase

    stock_worker_init = WorkerBase.__init__
    if not getattr(stock_worker_init, _MARK, False):

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            vllm_config = kwargs.get("vllm_config", args[0] if args else None)
            if requested_by(vllm_config):
                activate(by_config=True)  # before vLLM reads (and caches) its environment
            stock_worker_init(self, *args, **kwargs)

        _mark(__init__, stock_worker_init)
        WorkerBase.__init__ = __init__

    stock_init_kv = EngineCore._initialize_kv_caches
    if not getattr(stock_init_kv, _MARK, False):

        def _initialize_kv_caches(self: Any, vllm_config: Any) -> Any:
            asked = requested_by(vllm_config)
            if asked:
                activate(by_config=True)  # before the scheduler class and KV cache config
            kv_cache_config = stock_init_kv(self, vllm_config)
            if asked:
                check_workers(self.collective_rpc, vllm_config)
            return kv_cache_config

        _mark(_initialize_kv_caches, stock_init_kv)
        EngineCore._initialize_kv_caches = _initialize_kv_caches

    if not hasattr(WorkerWrapperBase, REPORT):
        setattr(WorkerWrapperBase, REPORT, _worker_report)


REPORT = "kvguard_report"
"""The method the engine core calls on every worker (``collective_rpc``) at start-up."""


def _worker_report(wrapper: Any) -> dict[str, bool | str]:
    """What a worker says about the guard in its process (after its KV cache was set up)."""
    import vllm.envs as envs

    runner = getattr(getattr(wrapper, "worker", None), "model_runner", None)
    kv_cache_config = getattr(runner, "kv_cache_config", None)
    return {
        "guard": _active,
        "nan_counting": bool(envs.VLLM_COMPUTE_NANS_IN_LOGITS),
        "per_request_nans": worker_nans.installed(),
        "zeroer": kv_cache_config is not None
        and bool(kv_cache_config.needs_kv_cache_zeroing)
        and worker_zeroes_blocks(runner),
        "audit": runner is not None and worker_audit.runner_audits(runner),
        "seal": runner is not None and worker_seals.runner_seals(runner),
        "zeroing": worker_zeroing.zeroing_in_use(runner),
    }


_MISSING = {
    "guard": "kvguard's plugin did not switch the guard on there",
    "nan_counting": f"it does not count NaN logits ({NAN_SETTING} is off there)",
    "per_request_nans": "its model runner counts NaN logits per row, not per request",
    "zeroer": "it did not build its KV block zeroer (quarantined blocks would be reused unwiped)",
    "audit": 'its model runner cannot run the KV audit ("audit": true): its attention '
    "backend's cache layout is one kvguard does not know",
    "seal": 'its model runner cannot seal the KV it writes ("seal": true): only V1\'s '
    "runner (vLLM 0.32/0.33, and vLLM's CPU build) and 0.34's standalone CPU runner read "
    "a step's counts back on the host, and kvguard must know every attention cache's layout",
}
"""What each key of a worker's report missing means; ``audit`` and ``seal`` are asked
only of an engine with the KV audit or seals on."""


def check_workers(collective_rpc: Any, vllm_config: Any) -> None:
    """Every worker counts NaN logits per request and built its block zeroer (and, with
    the KV audit on, can run it), or the engine refuses to start. (Pooling models run
    unguarded: nothing to check.) How many passed is kept for the scheduler's start-up
    line (:func:`~kvguard.adapters.vllm.config.workers_checked`)."""
    if is_pooling_model(vllm_config):
        return
    how = (
        "--additional-config kvguard settings"
        if isinstance(getattr(vllm_config, "additional_config", None), Mapping)
        and CONFIG_KEY in vllm_config.additional_config
        else f"{GUARD_ENV}=1"
    )
    try:
        reports = collective_rpc(REPORT)
    except Exception as exc:
        raise GuardConfigError(
            f"kvguard was asked for ({how}), but a vLLM worker does not know it ({exc!r}): "
            "kvguard's vLLM plugin did not run in that worker process. Install kvguard "
            "wherever vLLM runs a worker, and keep 'kvguard' in VLLM_PLUGINS if it is set."
        ) from exc
    guard = guard_config(vllm_config)
    optional = {"audit": guard.audit, "seal": guard.seal}
    asked = [key for key in _MISSING if optional.get(key, True)]
    problems = [
        f"worker {rank}: {_MISSING[key]}"
        for rank, report in enumerate(reports)
        for key in asked
        if not report.get(key)
    ]
    if problems:
        raise GuardConfigError(
            f"kvguard was asked for ({how}) but is not in force in every vLLM worker: "
            + "; ".join(problems)
            + ". The engine does not start half-guarded."
        )
    zeroing = sorted({str(report.get("zeroing", "unknown")) for report in reports})
    note_workers_checked(vllm_config, len(reports), ", ".join(zeroing))


def worker_zeroes_blocks(runner: Any) -> bool:
    """Whether the model runner applies ``new_block_ids_to_zero`` (vLLM's runners skip
    the list silently, or assert, without a zeroer): something zeroes its blocks
    (:func:`~kvguard.adapters.vllm.workers.zeroing.zeroing_in_use`)."""
    return worker_zeroing.zeroing_in_use(runner) != worker_zeroing.NO_ZEROING


def _mark(patched: Any, stock: Any) -> None:
    setattr(patched, _MARK, True)
    patched.__wrapped__ = stock
    patched.__doc__ = stock.__doc__


def _patch_zeroing() -> None:
    """``KVCacheConfig.needs_kv_cache_zeroing`` true: kvguard's scheduler sends
    quarantined blocks in ``new_block_ids_to_zero``, and the workers build their
    zeroer to apply them only then. vLLM's own answer stays readable
    (:func:`~kvguard.adapters.vllm.config.stock_needs_zeroing`)."""
    from vllm.v1.kv_cache_interface import KVCacheConfig

    if zeroing_is_a_field():
        # 0.34: a field that __post_init__ sets; vLLM's value is kept beside it.
        stock_post_init = KVCacheConfig.__post_init__
        if getattr(stock_post_init, _MARK, False):
            return

        def __post_init__(self: Any) -> None:
            stock_post_init(self)
            setattr(self, STOCK_ZEROING, self.needs_kv_cache_zeroing)
            self.needs_kv_cache_zeroing = True

        _mark(__post_init__, stock_post_init)
        KVCacheConfig.__post_init__ = __post_init__
        return

    current = KVCacheConfig.__dict__["needs_kv_cache_zeroing"]
    if getattr(current.fget, _MARK, False):
        return
    stock = current.fget

    def needs_kv_cache_zeroing(self: Any) -> bool:
        return True

    _mark(needs_kv_cache_zeroing, stock)
    KVCacheConfig.needs_kv_cache_zeroing = property(needs_kv_cache_zeroing)


def _patch_scheduler_cls() -> None:
    from vllm.config.scheduler import SchedulerConfig

    current = SchedulerConfig.get_scheduler_cls
    if getattr(current, _MARK, False):
        return

    def get_scheduler_cls(self: Any) -> Any:
        if self.scheduler_cls is None:
            from kvguard.adapters.vllm.scheduler.guarded import (
                GuardedAsyncScheduler,
                GuardedScheduler,
            )

            return GuardedAsyncScheduler if self.async_scheduling else GuardedScheduler
        return current(self)

    setattr(get_scheduler_cls, _MARK, True)
    get_scheduler_cls.__wrapped__ = current  # type: ignore[attr-defined]
    SchedulerConfig.get_scheduler_cls = get_scheduler_cls


def _patch_connector_cls() -> None:
    """vLLM's connector factory knows kvguard's gated classes by name, and gives each
    in place of vLLM's class it gates (the one table: :data:`.exits.coverage.GATED`)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name in GATED.values():
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, MODULE_PATH, name)
    current = KVConnectorFactory.get_connector_class
    if getattr(current, _MARK, False):
        return
    stock = current.__func__

    def get_connector_class(cls: Any, kv_transfer_config: Any) -> Any:
        connector_cls = stock(cls, kv_transfer_config)
        guarded = GATED.get((connector_cls.__module__, connector_cls.__name__))
        if guarded is not None:
            # Its stores would copy KV of steps not validated yet.
            import importlib

            return getattr(importlib.import_module(MODULE_PATH), guarded)
        return connector_cls

    setattr(get_connector_class, _MARK, True)
    get_connector_class.__wrapped__ = stock  # type: ignore[attr-defined]
    KVConnectorFactory.get_connector_class = classmethod(get_connector_class)


def _patch_engine_core_utility() -> None:
    """``kvguard_invalidate_tokens`` and ``kvguard_stats`` on vLLM's ``EngineCore``,
    callable from the front end as any engine-core utility
    (``engine_core.call_utility(...)`` on a multiprocess client; a plain call
    in-process): KV of a token prefix found corrupt after the fact is invalidated in the
    engine and purged from every gated tier (returns the counts: what crosses the
    process boundary); the guard's counters, read."""
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore, "kvguard_invalidate_tokens", None) is not None:
        return

    def kvguard_invalidate_tokens(
        self: Any, token_ids: list[int], descendants: bool = True
    ) -> dict[str, int]:
        invalidate = getattr(self.scheduler, "kvguard_invalidate_tokens", None)
        if invalidate is None:
            raise GuardConfigError(
                "kvguard_invalidate_tokens: this engine runs vLLM's own scheduler (the "
                "guard is off), which keeps no record of validated KV to invalidate"
            )
        report = invalidate(token_ids, descendants=descendants)
        return {
            "hashes": len(report.invalidation.hashes),
            "blocks_quarantined": len(report.invalidation.block_ids),
            "requests": len(report.invalidation.requests),
            **{f"purged:{tier}": len(h) for tier, h in report.purged.items()},
        }

    EngineCore.kvguard_invalidate_tokens = kvguard_invalidate_tokens

    def kvguard_stats(self: Any) -> dict[str, int]:
        """The guard's counters in this engine core (``GuardedScheduler.kvguard_stats``)."""
        stats = getattr(self.scheduler, "kvguard_stats", None)
        if stats is None:
            raise GuardConfigError(
                "kvguard_stats: this engine runs vLLM's own scheduler (the guard is off)"
            )
        result: dict[str, int] = stats()
        return result

    EngineCore.kvguard_stats = kvguard_stats


def _patch_fault_handler() -> None:
    """vLLM's engine fault tolerance (``EngineCoreSentinel.on_fault``) aborts every
    request after a fault in the busy loop; on a guarded scheduler its abort becomes
    :meth:`~kvguard.adapters.vllm.scheduler.guarded.GuardedScheduler.recover`: the requests
    resume from their validated KV after vLLM's ``retry``, and only those that cannot
    are ended (the sentinel sends their outputs as it sends the aborts)."""
    from vllm.v1.fault_tolerance.engine_core_sentinel import EngineCoreSentinel

    current = EngineCoreSentinel.on_fault
    if getattr(current, _MARK, False):
        return

    def on_fault(self: Any, exc: Exception) -> None:
        scheduler = self.engine.scheduler
        if not hasattr(scheduler, "kvguard_fault"):  # vLLM's own scheduler
            current(self, exc)
            return
        with scheduler.kvguard_fault():
            current(self, exc)

    setattr(on_fault, _MARK, True)
    on_fault.__wrapped__ = current  # type: ignore[attr-defined]
    on_fault.__doc__ = current.__doc__
    EngineCoreSentinel.on_fault = on_fault
