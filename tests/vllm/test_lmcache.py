"""LMCache against its real package (``lmcache``; not in the CI locks: its wheel pulls
CUDA array libraries): vLLM's ``LMCacheConnectorV1`` decides while a step is being
scheduled to save that step's KV (``save_spec.can_save`` in the step's metadata), and
its workers then save it from the forward, before the step's NaN count exists. kvguard
cannot hold that back, so a guarded scheduler refuses it before vLLM builds it -- and
accepts it on a decode instance (``kv_role="kv_consumer"``), where LMCache saves
nothing. The refusal itself needs no ``lmcache`` (tests/vllm/test_connector_gate.py).
"""

from __future__ import annotations

import pytest

pytestmark = [
    pytest.mark.vllm,
    # (lmcache's own imports warn about their dependencies' deprecations.)
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]
pytest.importorskip("vllm")
pytest.importorskip("lmcache", reason="LMCache's real package (pip install lmcache)")

from vllm.config import KVTransferConfig  # noqa: E402

from kvguard.adapters.vllm.config import GuardConfigError  # noqa: E402

from .harness import BLOCK, make_request, make_scheduler, model_output  # noqa: E402

PROMPT = list(range(100, 100 + 4 * BLOCK))


def _saves(s: object, nans: dict[str, int] | None = None) -> dict[str, bool]:
    """Run request "a"'s first step; what the step's LMCache metadata says to save."""
    s.add_request(make_request("a", PROMPT, max_tokens=2))  # type: ignore[attr-defined]
    so = s.schedule()  # type: ignore[attr-defined]
    saves = {
        m.req_id: bool(m.save_spec and m.save_spec.can_save)
        for m in so.kv_connector_metadata.requests
    }
    s.update_from_output(so, model_output(s, so, nans))  # type: ignore[attr-defined]
    return saves


def test_stock_lmcache_saves_a_step_decided_before_its_nan_count() -> None:
    """The save of the step that will have NaN logits is already decided when the step
    is scheduled: the workers carry it out during that forward."""
    s = make_scheduler(
        guarded=False,
        kv_transfer_config=KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both"),
    )
    assert _saves(s, {"a": 1}) == {"a": True}


def test_the_guard_refuses_lmcache_and_accepts_it_as_a_consumer() -> None:
    with pytest.raises(GuardConfigError, match="LMCacheConnectorV1: its workers save KV"):
        make_scheduler(
            kv_transfer_config=KVTransferConfig(
                kv_connector="LMCacheConnectorV1", kv_role="kv_both"
            )
        )
    s = make_scheduler(
        kv_transfer_config=KVTransferConfig(
            kv_connector="LMCacheConnectorV1", kv_role="kv_consumer"
        )
    )
    assert type(s.connector).__name__ == "LMCacheConnectorV1"
    assert not any(_saves(s).values())
