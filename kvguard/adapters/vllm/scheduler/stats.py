"""The guard's counters: attached to vLLM's stats for the front end, and read whole."""

from __future__ import annotations

from typing import Any

from kvguard.adapters.vllm.metrics import connector_counters
from kvguard.adapters.vllm.scheduler.startup import _GuardStartUp


class _Stats(_GuardStartUp):
    """``make_stats`` and ``kvguard_stats``."""

    def make_stats(self, *args: Any, **kwargs: Any) -> Any:
        # vLLM's stats travel to the front end (API server), which serves /metrics;
        # kvguard's counters go with them (kvguard.adapters.vllm.metrics).
        stats = super().make_stats(*args, **kwargs)  # type: ignore[misc]
        if stats is not None:
            self._kvguard_stats_sender.attach(stats, self)
        return stats

    def kvguard_stats(self) -> dict[str, int]:
        """The guard's counters: the adapter's plus kvguard's pool counters."""
        out = self.kvguard_metrics.as_dict()
        counters = self.kvguard_pool.core.counters()  # (stats() would walk every block)
        out["blocks_quarantined"] = counters.blocks_quarantined
        out["deferred_publications"] = counters.deferred_publications
        out["dropped_acks"] = counters.dropped_acks
        out["blocks_published"] = counters.blocks_published
        out["stores_started"] = counters.stores_started
        out["stores_acknowledged"] = counters.stores_acknowledged
        out["blocks_sealed"] = counters.blocks_sealed
        out.update(connector_counters(self) or {})
        return out
