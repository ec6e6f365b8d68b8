"""kvguard inside vLLM (0.32.x, 0.33.x, 0.34.x: ``SUPPORTED``): the pool under
``KVCacheManager``, guarded schedulers (and their fault recovery, ``recover()``), the
gated KV connectors, and the purge of corrupt tier copies.

Importing this package checks the installed vLLM version and imports vLLM; ``import
kvguard`` alone never does. Turn the guard on with no code change (the
``vllm.general_plugins`` entry point, :mod:`kvguard.adapters.vllm.plugin`)::

    KVGUARD_GUARD=1 vllm serve MODEL

See docs/vllm.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvguard.adapters.vllm._compat import SUPPORTED, UnsupportedVllmError, check_vllm_version
from kvguard.adapters.vllm.config import GuardConfig, GuardConfigError

if TYPE_CHECKING:
    from kvguard.adapters.vllm.exits.example_connector import GuardedExampleConnector
    from kvguard.adapters.vllm.exits.lmcache import GuardedLMCacheConnectorV1
    from kvguard.adapters.vllm.exits.offloading import GuardedOffloadingConnector
    from kvguard.adapters.vllm.exits.simple_cpu import GuardedSimpleCPUOffloadConnector
    from kvguard.adapters.vllm.exits.tier_purge import TierPurgeReport
    from kvguard.adapters.vllm.pool.block_pool import GuardedBlockPool, GuardModeUnsupported
    from kvguard.adapters.vllm.pool.manager import build_kv_cache_manager, install_guarded_pool
    from kvguard.adapters.vllm.scheduler.guarded import GuardedAsyncScheduler, GuardedScheduler
    from kvguard.adapters.vllm.scheduler.recovery import RecoveryReport, ResumedRequest

__all__ = [
    "SUPPORTED",
    "GuardConfig",
    "GuardConfigError",
    "GuardModeUnsupported",
    "GuardedAsyncScheduler",
    "GuardedBlockPool",
    "GuardedExampleConnector",
    "GuardedLMCacheConnectorV1",
    "GuardedOffloadingConnector",
    "GuardedScheduler",
    "GuardedSimpleCPUOffloadConnector",
    "RecoveryReport",
    "ResumedRequest",
    "TierPurgeReport",
    "UnsupportedVllmError",
    "build_kv_cache_manager",
    "check_vllm_version",
    "install_guarded_pool",
]

_LAZY = {
    "GuardedBlockPool": "pool.block_pool",
    "GuardModeUnsupported": "pool.block_pool",
    "build_kv_cache_manager": "pool.manager",
    "install_guarded_pool": "pool.manager",
    "GuardedScheduler": "scheduler.guarded",
    "GuardedAsyncScheduler": "scheduler.guarded",
    "GuardedOffloadingConnector": "exits.offloading",
    "GuardedSimpleCPUOffloadConnector": "exits.simple_cpu",
    "GuardedExampleConnector": "exits.example_connector",
    "GuardedLMCacheConnectorV1": "exits.lmcache",
    "TierPurgeReport": "exits.tier_purge",
    "RecoveryReport": "scheduler.recovery",
    "ResumedRequest": "scheduler.recovery",
}


def __getattr__(name: str) -> Any:
    # vLLM is imported on first use of a name that needs it, not on package import.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
