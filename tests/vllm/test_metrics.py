"""The guard's counters reach Prometheus through the registry vLLM's /metrics serves."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
prometheus_client = pytest.importorskip("prometheus_client")

from .harness import BLOCK, make_request, make_scheduler, step  # noqa: E402


def _sample(name: str, label: str) -> float:
    value = prometheus_client.REGISTRY.get_sample_value(name, {"kvguard_scheduler": label})
    assert value is not None, f"{name} not exported for scheduler {label}"
    return value


def test_aborts_quarantine_zeroing_and_deferred_publications_are_exported() -> None:
    s = make_scheduler(max_num_batched_tokens=BLOCK)
    label = s.kvguard_metrics_label
    assert label is not None
    prompt = list(range(4000, 4000 + 3 * BLOCK))
    s.add_request(make_request("a", prompt))
    step(s)
    step(s, {"a": 2})  # a's second chunk has NaN logits: a is aborted
    s.add_request(make_request("b", prompt))
    step(s)  # b reuses (and zeroes) a's quarantined block
    assert _sample("kvguard_vllm_requests_aborted_total", label) == 1
    assert _sample("kvguard_blocks_quarantined_total", label) == 1
    assert _sample("kvguard_vllm_blocks_zeroed_total", label) == 1
    assert _sample("kvguard_deferred_publications_total", label) >= 2
    assert _sample("kvguard_dropped_acks_total", label) == 0
    assert s.kvguard_stats()["requests_aborted"] == 1


def test_each_scheduler_is_its_own_series() -> None:
    a = make_scheduler()
    b = make_scheduler()
    assert a.kvguard_metrics_label != b.kvguard_metrics_label
    a.add_request(make_request("x", list(range(5000, 5010))))
    step(a, {"x": 1})
    assert _sample("kvguard_vllm_requests_aborted_total", a.kvguard_metrics_label) == 1
    assert _sample("kvguard_vllm_requests_aborted_total", b.kvguard_metrics_label) == 0


def test_the_offloading_connectors_counters_are_exported() -> None:
    from .harness import connector_output as output
    from .test_offloading import offload_scheduler, store_blocks

    s = offload_scheduler()
    label = s.kvguard_metrics_label
    s.add_request(make_request("a", list(range(6000, 6000 + 2 * BLOCK)), max_tokens=1))
    so = s.schedule()
    s.update_from_output(so, output(s, so))
    so = s.schedule()  # a's chunks, validated, are offered for storing
    jobs = list(store_blocks(so))
    s.update_from_output(so, output(s, so, completed=jobs))
    assert _sample("kvguard_vllm_offload_store_jobs_total", label) == len(jobs) == 1
    assert _sample("kvguard_vllm_offload_chunks_stored_total", label) == 2
    assert _sample("kvguard_vllm_offload_chunks_evicted_total", label) == 0
    stats = s.kvguard_stats()
    assert stats["offload_chunks_stored"] == 2 and stats["offload_store_jobs"] == 1


def test_a_scheduler_without_a_guarded_connector_exports_no_connector_series() -> None:
    s = make_scheduler()
    name = "kvguard_vllm_offload_store_jobs_total"
    labels = {"kvguard_scheduler": s.kvguard_metrics_label}
    assert prometheus_client.REGISTRY.get_sample_value(name, labels) is None
    assert "offload_store_jobs" not in s.kvguard_stats()
