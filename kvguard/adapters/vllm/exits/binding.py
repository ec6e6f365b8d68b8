"""KV connectors bound to the pool kvguard put in place of vLLM's.

vLLM's ``Scheduler.__init__`` builds its ``KVCacheManager`` and binds the KV connector
to it (``bind_kv_cache_manager``, which hands the block pool to
``bind_gpu_block_pool``), and vLLM 0.33's auxiliary-output connector keeps the pool
too -- all before the guarded scheduler replaces the pool by kvguard's
(:func:`kvguard.adapters.vllm.pool.manager.install_guarded_pool`). A connector left on the
discarded pool would touch, look up and read blocks no request holds any more:
SimpleCPU offloading (its ``_gpu_block_pool``), Mooncake's store, UMBP.

:func:`rebind_connectors` binds them again, through the same vLLM calls (plain
assignments in every connector vLLM ships; ``MultiConnector`` passes them to its
children), and :func:`stale_references` then walks what the connectors hold for the
old pool: a connector that keeps it anyway makes the engine refuse to start, by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvguard.adapters.vllm._compat import aux_output_connector_binds_pool

_MAX_DEPTH = 6


def rebind_connectors(scheduler: Any) -> None:
    """Bind the scheduler's connectors to its KV cache manager (and pool) again."""
    connector = getattr(scheduler, "connector", None)
    if connector is not None:
        connector.bind_kv_cache_manager(scheduler.kv_cache_manager)
    aux = getattr(scheduler, "aux_output_connector", None)
    if aux is not None and aux_output_connector_binds_pool():
        # Built from the manager in Scheduler.__init__, nothing recorded yet: built
        # again the same way.
        scheduler.aux_output_connector = type(aux)(scheduler.kv_cache_manager, connector)


def stale_references(scheduler: Any, old_pool: Any) -> list[str]:
    """Attribute paths (``connector.connector_scheduler._gpu_block_pool``) by which the
    scheduler's connectors still reach ``old_pool``."""
    roots = {
        name: getattr(scheduler, name, None)
        for name in ("connector", "aux_output_connector", "ec_connector")
    }
    skip = {id(scheduler), id(scheduler.kv_cache_manager)}  # swapped by kvguard itself
    found: list[str] = []
    for name, root in roots.items():
        if root is not None:
            found += _paths_to(root, old_pool, name, skip)
    return found


def _paths_to(root: Any, target: Any, path: str, seen: set[int]) -> list[str]:
    out = []
    stack = [(root, path, 0)]
    while stack:
        obj, where, depth = stack.pop()
        if obj is target:
            out.append(where)
            continue
        if id(obj) in seen or depth >= _MAX_DEPTH:
            continue
        seen.add(id(obj))
        for key, value in _children(obj):
            stack.append((value, f"{where}{key}", depth + 1))
    return out


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    """What an object holds that may lead to a block pool: the attributes of vLLM's
    (and kvguard's) objects, and the items of their lists, tuples and dicts."""
    if isinstance(obj, (list, tuple, set, frozenset)):
        if len(obj) <= 64:  # block id lists and the like hold no pool
            for i, item in enumerate(obj):
                yield f"[{i}]", item
        return
    if isinstance(obj, dict):
        if len(obj) <= 64:
            for key, item in obj.items():
                yield f"[{key!r}]", item
        return
    module = type(obj).__module__ or ""
    if not module.startswith(("vllm", "kvguard")) and not hasattr(obj, "bind_gpu_block_pool"):
        return  # tensors, locks, threads, the standard library
    attrs = getattr(obj, "__dict__", None)
    if attrs:
        for key, value in list(attrs.items()):
            yield f".{key}", value
    for key in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, key):
            yield f".{key}", getattr(obj, key)
