from __future__ import annotations

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from kvguard.prometheus import PoolCollector  # noqa: E402

from .conftest import make_pool  # noqa: E402
from .helpers import prefill  # noqa: E402


def test_collector_exposes_states_and_counters() -> None:
    pool = make_pool(8, 4)
    prefill(pool, "a", list(range(8)))
    pool.fail_step("a")
    registry = prometheus_client.CollectorRegistry()
    registry.register(PoolCollector(pool, labels={"engine": "e0"}))
    get = registry.get_sample_value
    assert get("kvguard_blocks", {"engine": "e0", "state": "quarantined"}) == 2
    assert get("kvguard_blocks", {"engine": "e0", "state": "free"}) == 6
    assert get("kvguard_requests_aborted_total", {"engine": "e0"}) == 1
    assert get("kvguard_deferred_publications_total", {"engine": "e0"}) == 2
    assert get("kvguard_free_blocks", {"engine": "e0"}) == 6
    text = prometheus_client.generate_latest(registry).decode()
    assert "kvguard_dropped_acks_total" in text
