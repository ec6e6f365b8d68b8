"""Prometheus collector for a pool (optional extra: ``pip install kvguard[prometheus]``).

::

    from prometheus_client import REGISTRY
    from kvguard.prometheus import PoolCollector
    REGISTRY.register(PoolCollector(pool, labels={"engine": "0"}))

Gauges: blocks per state, free/evictable blocks, open requests, queue lengths.
Counters: every cumulative counter of :class:`kvguard.Counters` (aborts, quarantined
and zeroed blocks, deferred publications, dropped acknowledgements, ...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvguard.pool import BlockPool
from kvguard.stats import Counters

_COUNTER_HELP = {
    f.name: (f.metadata.get("help") or f.name.replace("_", " "))
    for f in dataclasses.fields(Counters)
}


class PoolCollector(Collector):
    """Reads ``pool.stats()`` at scrape time; costs nothing between scrapes."""

    def __init__(
        self, pool: BlockPool, *, prefix: str = "kvguard", labels: Mapping[str, str] | None = None
    ) -> None:
        self._pool = pool
        self._prefix = prefix
        self._labels = dict(labels or {})

    def collect(self) -> Iterator[Metric]:
        stats = self._pool.stats()
        names = list(self._labels)
        values = list(self._labels.values())
        p = self._prefix

        by_state = GaugeMetricFamily(f"{p}_blocks", "Blocks per state", labels=[*names, "state"])
        for state, count in stats.blocks_by_state.items():
            by_state.add_metric([*values, state.value], count)
        yield by_state

        for name, doc, value in (
            ("free_blocks", "Blocks an allocation can take now", stats.num_free),
            ("evictable_blocks", "Cached blocks with no reference", stats.num_evictable),
            ("requests", "Open requests", stats.num_requests),
            ("zero_queue_blocks", "Blocks waiting to be zeroed", stats.zero_queue_blocks),
            ("zero_queue_slots", "Token slots waiting to be wiped", stats.zero_queue_slots),
            ("stores_in_flight", "Tier stores not acknowledged yet", stats.stores_in_flight),
            ("usage_ratio", "Fraction of blocks held", stats.usage),
        ):
            gauge = GaugeMetricFamily(f"{p}_{name}", doc, labels=names)
            gauge.add_metric(values, value)
            yield gauge

        for field in dataclasses.fields(Counters):
            counter = CounterMetricFamily(
                f"{p}_{field.name}", _COUNTER_HELP[field.name], labels=names
            )
            counter.add_metric(values, getattr(stats.counters, field.name))
            yield counter
