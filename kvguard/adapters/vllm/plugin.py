"""vLLM plugin (``vllm.general_plugins`` entry point ``kvguard``): the guard with no code change.

vLLM runs :func:`register` in every process it starts (engine core, each worker). It
does nothing unless ``KVGUARD_GUARD=1`` is set explicitly; then, in that process:

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
* registers ``GuardedOffloadingConnector`` with vLLM's connector factory and gives it
  to ``kv_connector="OffloadingConnector"`` (a subclass: workers run vLLM's code;
  store jobs cover validated blocks only, see :mod:`kvguard.adapters.vllm.offloading`);
* makes vLLM's model runners count NaN logits per request rather than per logits row,
  which is what lets the guard validate steps under speculative decoding (see
  :mod:`kvguard.adapters.vllm.worker_nans`; applied when a runner's module is imported).

Idempotent: vLLM may load plugins several times per process.
"""

from __future__ import annotations

import os
from typing import Any

from kvguard.adapters.vllm import worker_nans
from kvguard.adapters.vllm._compat import require_supported_vllm
from kvguard.adapters.vllm.config import GuardConfigError

GUARD_ENV = "KVGUARD_GUARD"
NAN_SETTING = "VLLM_COMPUTE_NANS_IN_LOGITS"
_ON = ("1", "true", "yes", "on")
_MARK = "_kvguard_plugin"


def requested(environ: Any = os.environ) -> bool:
    """Whether the plugin was asked to switch the guard on (explicit ``KVGUARD_GUARD=1``)."""
    return str(environ.get(GUARD_ENV, "")).strip().lower() in _ON


def register() -> None:
    """The ``vllm.general_plugins`` entry point."""
    if not requested():
        return
    require_supported_vllm()
    nan = os.environ.get(NAN_SETTING)
    if nan is None:
        os.environ[NAN_SETTING] = "1"
    elif nan.strip().lower() not in _ON:
        raise GuardConfigError(
            f"{GUARD_ENV}=1 validates each step by vLLM's per-request NaN logit counts, but "
            f"{NAN_SETTING}={nan!r} switches them off; unset it or set it to 1"
        )
    _patch_zeroing()
    _patch_scheduler_cls()
    _patch_connector_cls()
    worker_nans.install()


def worker_counts_per_request(environ: Any = os.environ) -> bool:
    """Whether vLLM's workers count NaN logits per request: the plugin ran in this
    process with ``KVGUARD_GUARD=1``. vLLM loads its plugins in the engine core before
    it builds the scheduler and in every worker before its model runner, under the same
    settings, so the workers were patched too -- unless the plugin did not run here
    either (``VLLM_PLUGINS`` leaving ``kvguard`` out, or a scheduler built by hand)."""
    return requested(environ) and worker_nans.installed()


def _patch_zeroing() -> None:
    from vllm.v1.kv_cache_interface import KVCacheConfig

    current = KVCacheConfig.__dict__["needs_kv_cache_zeroing"]
    if getattr(current.fget, _MARK, False):
        return
    stock = current.fget

    def needs_kv_cache_zeroing(self: Any) -> bool:
        # kvguard's scheduler sends quarantined blocks in new_block_ids_to_zero;
        # the worker must build its zeroer to apply them.
        return True

    setattr(needs_kv_cache_zeroing, _MARK, True)
    needs_kv_cache_zeroing.__wrapped__ = stock  # type: ignore[attr-defined]
    needs_kv_cache_zeroing.__doc__ = stock.__doc__
    KVCacheConfig.needs_kv_cache_zeroing = property(needs_kv_cache_zeroing)


def stock_needs_zeroing(kv_cache_config: Any) -> bool:
    """What vLLM itself decides for ``kv_cache_config`` (the plugin's patch undone)."""
    prop = type(kv_cache_config).__dict__.get("needs_kv_cache_zeroing")
    fget = getattr(prop, "fget", None)
    if fget is None:
        return bool(kv_cache_config.needs_kv_cache_zeroing)
    return bool(getattr(fget, "__wrapped__", fget)(kv_cache_config))


def _patch_scheduler_cls() -> None:
    from vllm.config.scheduler import SchedulerConfig

    current = SchedulerConfig.get_scheduler_cls
    if getattr(current, _MARK, False):
        return

    def get_scheduler_cls(self: Any) -> Any:
        if self.scheduler_cls is None:
            from kvguard.adapters.vllm.scheduler import (
                GuardedAsyncScheduler,
                GuardedScheduler,
            )

            return GuardedAsyncScheduler if self.async_scheduling else GuardedScheduler
        return current(self)

    setattr(get_scheduler_cls, _MARK, True)
    get_scheduler_cls.__wrapped__ = current  # type: ignore[attr-defined]
    SchedulerConfig.get_scheduler_cls = get_scheduler_cls


GUARDED_CONNECTOR = "GuardedOffloadingConnector"
_STOCK_CONNECTOR = (
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    "OffloadingConnector",
)


def _patch_connector_cls() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if GUARDED_CONNECTOR not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            GUARDED_CONNECTOR, "kvguard.adapters.vllm.offloading", GUARDED_CONNECTOR
        )
    current = KVConnectorFactory.get_connector_class
    if getattr(current, _MARK, False):
        return
    stock = current.__func__

    def get_connector_class(cls: Any, kv_transfer_config: Any) -> Any:
        connector_cls = stock(cls, kv_transfer_config)
        if (connector_cls.__module__, connector_cls.__name__) == _STOCK_CONNECTOR:
            # Its store jobs would copy KV of steps not validated yet.
            from kvguard.adapters.vllm.offloading import GuardedOffloadingConnector

            return GuardedOffloadingConnector
        return connector_cls

    setattr(get_connector_class, _MARK, True)
    get_connector_class.__wrapped__ = stock  # type: ignore[attr-defined]
    KVConnectorFactory.get_connector_class = classmethod(get_connector_class)
