"""What the guard did, as cumulative counters, and their Prometheus export.

``scheduler.kvguard_stats()`` merges the adapter's counters (:class:`GuardMetrics`) with
the pool's. When ``prometheus_client`` is installed (vLLM depends on it), each guarded
scheduler registers itself with :func:`register_prometheus`: one collector on
``prometheus_client.REGISTRY`` -- the registry vLLM's ``/metrics`` endpoint serves --
exports every live guarded scheduler (label ``kvguard_scheduler``), read at scrape time:

* ``kvguard_vllm_requests_aborted_total`` and the other :class:`GuardMetrics` counters;
* kvguard's pool metrics (:class:`kvguard.prometheus.PoolCollector`): blocks per state,
  ``kvguard_blocks_quarantined_total``, ``kvguard_blocks_zeroed_total``,
  ``kvguard_deferred_publications_total``, ``kvguard_dropped_acks_total``, ...;
* the guarded offloading connector's counters (summed over a ``MultiConnector``'s
  children): ``kvguard_vllm_offload_store_jobs_total``, ...
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

LABEL = "kvguard_scheduler"


@dataclass(slots=True)
class GuardMetrics:
    requests_aborted: int = 0
    """Requests finished with FINISHED_ERROR because a step's logits had NaN (or, with
    the KV audit on, the KV it filled had NaN or an infinity)."""
    steps_validated: int = 0
    """Per-request step results that validated (clean NaN count)."""
    steps_unchecked: int = 0
    """Per-request step results without a NaN count: what they filled is validated only
    by a later step of the request that is counted clean."""
    blocks_zeroed: int = 0
    """Block ids handed to the worker through ``new_block_ids_to_zero``."""
    window_contract_breaks: int = 0
    """Window frees of blocks a step in flight may still write (vLLM frees only below
    a request's processed tokens): the blocks were quarantined. Expected to stay 0."""
    steps_lost: int = 0
    """Scheduled steps whose output never came back (vLLM's fault tolerance drops the
    outputs of the steps in flight): what they filled waits for a counted step."""

    blocks_audited: int = 0
    """Blocks sent to the workers' KV audit (``"audit": true``): those steps filled."""
    requests_failed_audit: int = 0
    """Requests aborted because the KV audit found NaN or an infinity in a block their
    step filled (counted where the worker tells the audit from the logits: V1 runners
    under synchronous scheduling; otherwise in ``requests_aborted`` only)."""

    requests_recovered: int = 0
    """Requests ``recover()`` rolled back to their validated KV (they resume)."""
    tokens_rolled_back: int = 0
    """Tokens the lost steps of recovered requests had computed: recomputed."""
    requests_unrecoverable: int = 0
    """Requests ``recover()`` could not resume, finished with an error."""

    connector_handoffs_withheld: int = 0
    """Finished requests whose KV was not handed to a KV connector (no send, no
    save at ``request_finished``): their last step was not counted clean."""
    tier_copies_purged: int = 0
    """Tier copies (CPU tiers, connector stores) dropped because their hash was
    invalidated (``kvguard_invalidate``, KV that failed to load)."""
    handoffs_refused: int = 0
    """Reads of KV handed over by a prefill instance (NIXL) whose blocks did not give
    their seals, or that carried none (seals on): failed loads."""

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


_HELP = {
    "requests_aborted": (
        "Requests finished with an error because a step's logits (or audited KV) had NaN"
    ),
    "steps_validated": "Per-request steps whose logits were NaN-free",
    "steps_unchecked": (
        "Per-request steps without a NaN count (their blocks wait for a counted step)"
    ),
    "blocks_zeroed": "Block ids sent to the workers in new_block_ids_to_zero",
    "window_contract_breaks": (
        "Window frees of blocks a step in flight may still write (quarantined)"
    ),
    "steps_lost": "Scheduled steps whose output never came back (engine fault tolerance)",
    "blocks_audited": "Blocks the workers' KV audit scanned (blocks steps filled)",
    "requests_failed_audit": "Requests aborted because the KV audit found NaN/Inf in their KV",
    "requests_recovered": "Requests recover() rolled back to their validated KV (they resume)",
    "tokens_rolled_back": "Tokens of recovered requests' lost steps (recomputed)",
    "requests_unrecoverable": "Requests recover() could not resume (finished with an error)",
    "connector_handoffs_withheld": (
        "Finished requests whose KV no connector received (last step not counted clean)"
    ),
    "tier_copies_purged": "Tier copies dropped because their hash was invalidated",
    "handoffs_refused": (
        "Reads of KV handed over by a prefill instance that did not verify by their seals"
    ),
}

CONNECTOR_HELP = {
    "offload_store_jobs": "Store jobs to the CPU tier that passed kvguard's tier gate",
    "offload_store_jobs_cancelled": "Store jobs cancelled for a block kvguard refused",
    "offload_store_jobs_failed": "Store jobs the workers reported failed (vLLM 0.34): no copy kept",
    "offload_chunks_stored": "Chunks stored to the CPU tier with every ticket acknowledged",
    "offload_chunks_discarded": "Chunks discarded from the CPU tier for a late acknowledgement",
    "offload_chunks_evicted": "Chunks the CPU tier evicted to make room for a store",
    "offload_chunks_purged": (
        "Chunks dropped from the CPU tier: a hash they hold was invalidated, or a load of "
        "them did not verify by its seals"
    ),
    "offload_loads_refused": (
        "CPU-tier loads refused: the loaded KV did not verify by its seals (vLLM's "
        "kv_load_failure_policy recomputes or fails the request)"
    ),
}
"""The guarded CPU offloading connectors' counters (``kvguard_counters``), with their
help."""
STORAGE_COUNTERS = {
    "storage_stores_committed": "Shared-storage folders put in place after their step validated",
    "storage_stores_discarded": "Shared-storage folders deleted unseen (their step failed)",
    "storage_folders_purged": (
        "Shared-storage folders deleted: a hash invalidated, or a step on their KV failed"
    ),
    "storage_loads_refused": (
        "Shared-storage loads refused: the folder was unreadable or did not verify by its seals"
    ),
}
"""The guarded example (shared-storage) connector's counters, with their help."""

LMCACHE_COUNTERS = {
    "lmcache_chunks_stored": "LMCache chunks saved after every block of theirs validated",
    "lmcache_hits_cut": (
        "LMCache hits cut before a chunk kvguard holds no seal for (seals on: recomputed)"
    ),
    "lmcache_chunks_purged": (
        "LMCache chunks removed: a hash they hold was invalidated, or a load of them did "
        "not verify by its seals"
    ),
    "lmcache_loads_refused": (
        "LMCache loads refused: the loaded KV did not verify by its seals (vLLM's "
        "kv_load_failure_policy recomputes or fails the request)"
    ),
}
"""The guarded LMCache connector's counters, with their help."""

SERVED_CONNECTOR_HELP = {**CONNECTOR_HELP, **STORAGE_COUNTERS, **LMCACHE_COUNTERS}
"""Every guarded connector's counters, served on ``/metrics`` (0 without one)."""


_lock = threading.Lock()
_live: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_ids = itertools.count()
_registered = False


class _GuardCollector:
    """Every live guarded scheduler's counters, one sample per scheduler."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        from kvguard.prometheus import PoolCollector

        live = sorted(_live.items())
        for name in GuardMetrics.__slots__:
            counter = CounterMetricFamily(f"kvguard_vllm_{name}", _HELP[name], labels=[LABEL])
            for key, scheduler in live:
                counter.add_metric([key], getattr(scheduler.kvguard_metrics, name))
            yield counter
        connectors = [(key, connector_counters(scheduler)) for key, scheduler in live]
        for name, help_text in SERVED_CONNECTOR_HELP.items():
            counter = CounterMetricFamily(f"kvguard_vllm_{name}", help_text, labels=[LABEL])
            for key, counters in connectors:
                if counters is not None:
                    counter.add_metric([key], counters.get(name, 0))
            yield counter
        merged: dict[str, Any] = {}
        for key, scheduler in live:
            family: Any
            for family in PoolCollector(scheduler.kvguard_pool.core, labels={LABEL: key}).collect():
                if family.name in merged:
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = family
        yield from merged.values()


def connector_counters(scheduler: Any) -> dict[str, int] | None:
    """The counters of the scheduler's guarded connectors (several inside a
    ``MultiConnector``), summed; None without one."""
    out: dict[str, int] | None = None
    for connector in scheduler._kvguard_connectors():
        stats = getattr(connector, "kvguard_stats", None)
        if stats is not None:
            out = out if out is not None else {}
            for name, value in stats().items():
                out[name] = out.get(name, 0) + value
    return out


def register_prometheus(scheduler: Any) -> str | None:
    """Export ``scheduler``'s counters on prometheus_client's default registry; returns
    its label value, or None when prometheus_client is not installed."""
    global _registered
    try:
        from prometheus_client import REGISTRY
    except ImportError:  # pragma: no cover - vLLM depends on prometheus_client
        return None
    with _lock:
        key = str(next(_ids))
        _live[key] = scheduler
        if not _registered:
            REGISTRY.register(_GuardCollector())
            _registered = True
    return key


# ---------------------------------------------------------------------- to the front end
#
# /metrics is served by the API server process; the guarded scheduler runs in the
# engine-core process, whose registry (above) no scrape reaches. vLLM's own counters
# travel from the engine core to the front end in the ``SchedulerStats`` of each
# step's outputs, so kvguard's do too: as extra keys ``"kvguard:<counter>"`` of its
# ``num_kv_fetch_reqs_by_stage`` dict (the one free-form ``str -> int`` field of
# ``SchedulerStats`` in 0.32 and 0.33; vLLM's readers look up their own stage names in
# it). The front end takes them out before vLLM's stat loggers see the stats
# (:func:`install_front_end`) and serves the latest values per engine.

STATS_PREFIX = "kvguard:"
SEND_INTERVAL_S = 1.0
"""kvguard's counters ride on at most one ``SchedulerStats`` per this many seconds,
and on the one of the step that leaves the engine idle (no request left), so that the
front end has the final values. (Building them costs microseconds: not every step.)"""


class StatsSender:
    """Engine-core side: puts the scheduler's counters on the stats vLLM sends."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last = float("-inf")

    def attach(self, stats: Any, scheduler: Any) -> None:
        # A step that leaves the engine idle always sends: the engine makes no stats
        # again until the next request, and a request that came and went within one
        # step (a guard abort, say) would otherwise stay unreported until then.
        now = time.monotonic()
        if scheduler.requests and now - self._last < SEND_INTERVAL_S:
            return
        self._last = now
        carrier = stats.num_kv_fetch_reqs_by_stage
        for name, value in scheduler.kvguard_stats().items():
            carrier[STATS_PREFIX + name] = value


_front_end: dict[int, dict[str, int]] = {}
"""Engine index -> the latest kvguard counters it sent (front-end process)."""
_front_end_registered = False


def take_from_stats(stats: Any, engine_index: int) -> None:
    """Front end: move kvguard's counters out of ``stats`` into what /metrics serves."""
    global _front_end_registered
    carrier = getattr(stats, "num_kv_fetch_reqs_by_stage", None)
    if not carrier:
        return
    ours = [key for key in carrier if key.startswith(STATS_PREFIX)]
    if not ours:
        return
    counters = _front_end.setdefault(engine_index, {})
    for key in ours:
        counters[key[len(STATS_PREFIX) :]] = carrier.pop(key)
    if not _front_end_registered:
        try:
            from prometheus_client import REGISTRY
        except ImportError:  # pragma: no cover - vLLM depends on prometheus_client
            return
        with _lock:
            if not _front_end_registered:
                REGISTRY.register(_FrontEndCollector())
                _front_end_registered = True


def front_end_counters() -> dict[int, dict[str, int]]:
    """Engine index -> kvguard's counters as the front end last received them."""
    return {engine: dict(counters) for engine, counters in _front_end.items()}


class _FrontEndCollector:
    """``kvguard:<counter>_total{engine="<index>"}``, one sample per engine."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        engines = sorted(_front_end.items())
        names = sorted({name for _, counters in engines for name in counters})
        for name in names:
            counter = CounterMetricFamily(
                f"kvguard:{name}",
                _FRONT_END_HELP.get(name, name.replace("_", " ")),
                labels=["engine"],
            )
            for engine, counters in engines:
                if name in counters:
                    counter.add_metric([str(engine)], counters[name])
            yield counter


_FRONT_END_HELP = {
    **_HELP,
    **SERVED_CONNECTOR_HELP,
    "blocks_quarantined": "Blocks quarantined (written by a failed or never-validated step)",
    "deferred_publications": "Full blocks kept out of the prefix cache until their step validated",
    "dropped_acks": "Tier store acknowledgements dropped (block quarantined or reused meanwhile)",
    "blocks_published": "Blocks published to the prefix cache after validation",
    "stores_started": "Tier stores started for validated blocks",
    "stores_acknowledged": "Tier stores acknowledged",
    "blocks_sealed": "Blocks validated with the workers' seal of their KV",
}


def install_front_end() -> None:
    """Make vLLM's front end (``StatLoggerManager.record``) take kvguard's counters out
    of each engine's ``SchedulerStats`` before its stat loggers see them. Idempotent;
    a no-op for stats that carry none."""
    from vllm.v1.metrics.loggers import StatLoggerManager

    stock = StatLoggerManager.record
    if getattr(stock, "_kvguard_plugin", False):
        return

    def record(self: Any, *args: Any, **kwargs: Any) -> Any:
        stats = kwargs.get("scheduler_stats", args[0] if args else None)
        if stats is not None:
            engine = kwargs.get("engine_idx", args[3] if len(args) > 3 else None)
            take_from_stats(stats, engine or 0)
        return stock(self, *args, **kwargs)

    record._kvguard_plugin = True  # type: ignore[attr-defined]
    record.__wrapped__ = stock  # type: ignore[attr-defined]
    StatLoggerManager.record = record
