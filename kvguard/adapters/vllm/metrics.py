"""What the guard did, as cumulative counters, and their Prometheus export.

``scheduler.kvguard_stats()`` merges the adapter's counters (:class:`GuardMetrics`) with
the pool's. When ``prometheus_client`` is installed (vLLM depends on it), each guarded
scheduler registers itself with :func:`register_prometheus`: one collector on
``prometheus_client.REGISTRY`` -- the registry vLLM's ``/metrics`` endpoint serves --
exports every live guarded scheduler (label ``kvguard_scheduler``), read at scrape time:

* ``kvguard_vllm_requests_aborted_total`` and the other :class:`GuardMetrics` counters;
* kvguard's pool metrics (:class:`kvguard.prometheus.PoolCollector`): blocks per state,
  ``kvguard_blocks_quarantined_total``, ``kvguard_blocks_zeroed_total``,
  ``kvguard_withheld_publications_total``, ``kvguard_dropped_acks_total``, ...;
* the guarded offloading connector's counters (summed over a ``MultiConnector``'s
  children): ``kvguard_vllm_offload_store_jobs_total``, ...
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

LABEL = "kvguard_scheduler"


@dataclass(slots=True)
class GuardMetrics:
    requests_aborted: int = 0
    """Requests finished with FINISHED_ERROR because a step's logits had NaN."""
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

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


_HELP = {
    "requests_aborted": "Requests finished with an error because a step's logits had NaN",
    "steps_validated": "Per-request steps whose logits were NaN-free",
    "steps_unchecked": (
        "Per-request steps without a NaN count (their blocks wait for a counted step)"
    ),
    "blocks_zeroed": "Block ids sent to the workers in new_block_ids_to_zero",
    "window_contract_breaks": (
        "Window frees of blocks a step in flight may still write (quarantined)"
    ),
    "steps_lost": "Scheduled steps whose output never came back (engine fault tolerance)",
}

CONNECTOR_HELP = {
    "offload_store_jobs": "Store jobs to the CPU tier that passed kvguard's tier gate",
    "offload_store_jobs_cancelled": "Store jobs cancelled for a block kvguard refused",
    "offload_chunks_stored": "Chunks stored to the CPU tier with every ticket acknowledged",
    "offload_chunks_discarded": "Chunks discarded from the CPU tier for a late acknowledgement",
    "offload_chunks_evicted": "Chunks the CPU tier evicted to make room for a store",
}
"""The guarded offloading connector's counters (``kvguard_counters``), with their help."""

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
        for name, help_text in CONNECTOR_HELP.items():
            counter = CounterMetricFamily(f"kvguard_vllm_{name}", help_text, labels=[LABEL])
            for key, counters in connectors:
                if counters is not None:
                    counter.add_metric([key], counters.get(name, 0))
            yield counter
        merged: dict[str, Any] = {}
        for key, scheduler in live:
            core = scheduler.kvguard_pool.core
            if core is None:
                continue
            family: Any
            for family in PoolCollector(core, labels={LABEL: key}).collect():
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
