"""The KV audit under vLLM's parallel layouts: refused where one worker does not hold
all of the KV (tensor, pipeline, context parallelism), since vLLM's executor returns
the per-request counts of one worker only; kept under data parallelism (each engine
core has its own workers). The real engines are in ``tests/e2e/test_parallel.py``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from kvguard.adapters.vllm.pool.block_pool import GuardModeUnsupported  # noqa: E402
from kvguard.adapters.vllm.scheduler.startup import refuse_audit_for_layout  # noqa: E402

from . import harness  # noqa: E402

SHARDING = [
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "prefill_context_parallel_size",
    "decode_context_parallel_size",
]


def _layout(**sizes: int) -> SimpleNamespace:
    return SimpleNamespace(**{name: sizes.get(name, 1) for name in SHARDING}, data_parallel_size=1)


@pytest.mark.parametrize("name", SHARDING)
def test_the_audit_is_refused_where_a_worker_holds_part_of_the_kv(name: str) -> None:
    with pytest.raises(GuardModeUnsupported, match=rf"KV audit .*\({name}=2\)"):
        refuse_audit_for_layout(_layout(**{name: 2}))


def test_the_audit_is_kept_with_one_worker_per_engine() -> None:
    refuse_audit_for_layout(_layout())
    dp = _layout()
    dp.data_parallel_size = 2
    refuse_audit_for_layout(dp)


@pytest.mark.parametrize("audit", [False, True], ids=["no-audit", "audit"])
def test_a_guarded_scheduler_under_tensor_parallelism(
    audit: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard itself runs under TP (NaN counts from the driver, zeroing sent to
    every rank); with the audit asked for, the scheduler refuses to start."""
    stock = harness.make_vllm_config

    def tensor_parallel(**kwargs: Any) -> Any:
        config = stock(**kwargs)
        config.parallel_config.tensor_parallel_size = 2
        return config

    monkeypatch.setattr(harness, "make_vllm_config", tensor_parallel)
    settings = {"audit": audit}
    if not audit:
        assert harness.make_scheduler(kvguard=settings).kvguard_pool is not None
        return
    with pytest.raises(GuardModeUnsupported, match=r"tensor_parallel_size=2"):
        harness.make_scheduler(kvguard=settings)
