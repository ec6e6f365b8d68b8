"""kvguard's counters reach the API server's /metrics: the guarded scheduler (engine
core) puts them on the ``SchedulerStats`` vLLM sends to the front end, and the front
end (kvguard's plugin in that process) takes them out before vLLM's stat loggers see
the stats and serves them as ``kvguard:<counter>_total{engine="<index>"}``.

Driven here with vLLM's real scheduler and its real ``StatLoggerManager`` (the front
end's), the stats handed over as the engine core's output handler hands them; the
whole path through ``vllm serve`` is tests/e2e/test_guard_stays_on.py.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from prometheus_client import REGISTRY, generate_latest  # noqa: E402
from vllm.v1.metrics.loggers import StatLoggerManager  # noqa: E402

from kvguard.adapters.vllm import metrics  # noqa: E402

from .harness import BLOCK, make_request, make_scheduler, model_output  # noqa: E402


def test_counters_ride_on_scheduler_stats_to_the_front_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(StatLoggerManager, "record", StatLoggerManager.record)
    metrics.install_front_end()
    s = make_scheduler()
    s.add_request(make_request("a", list(range(100, 100 + 3 * BLOCK)), max_tokens=4))
    s.add_request(make_request("b", list(range(300, 300 + 2 * BLOCK)), max_tokens=2))
    sent = []
    for _ in range(8):
        so = s.schedule()
        nans = {"a": 2} if "a" in so.num_scheduled_tokens else {}
        for eco in s.update_from_output(so, model_output(s, so, nans)).values():
            if eco.scheduler_stats is not None:
                sent.append(eco.scheduler_stats)
        if not s.requests:
            break
    last = sent[-1].num_kv_fetch_reqs_by_stage
    assert last[metrics.STATS_PREFIX + "requests_aborted"] == 1
    assert (
        last[metrics.STATS_PREFIX + "blocks_quarantined"] == s.kvguard_stats()["blocks_quarantined"]
    )

    front_end = StatLoggerManager(s.vllm_config, engine_idxs=[0])
    for stats in sent:
        front_end.record(scheduler_stats=stats, iteration_stats=None, engine_idx=0)
        # vLLM's stat loggers see vLLM's stats only.
        assert not any(k.startswith("kvguard") for k in stats.num_kv_fetch_reqs_by_stage)
    assert metrics.front_end_counters()[0] == s.kvguard_stats()
    scraped = generate_latest(REGISTRY).decode()
    assert 'kvguard:requests_aborted_total{engine="0"} 1.0' in scraped
    quarantined = s.kvguard_stats()["blocks_quarantined"]
    assert quarantined > 0
    assert f'kvguard:blocks_quarantined_total{{engine="0"}} {float(quarantined)}' in scraped


def test_a_pass_through_scheduler_sends_nothing() -> None:
    s = make_scheduler(kvguard={"enabled": False})
    s.add_request(make_request("a", list(range(100, 100 + BLOCK)), max_tokens=1))
    so = s.schedule()
    (eco,) = s.update_from_output(so, model_output(s, so)).values()
    assert not [k for k in eco.scheduler_stats.num_kv_fetch_reqs_by_stage if "kvguard" in k]
