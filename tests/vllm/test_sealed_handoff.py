"""Sealed prefill/decode handoffs at scheduler level (the end-to-end proof over NIXL is
``tests/e2e/test_sealed_nixl.py``): the prefill side's transfer parameters carry the
seal of each block handed over, the decode side sends each read's expected seals to
its workers, the workers' patch of vLLM's ``NixlConnector`` refuses blocks that do not
give them, and the refused read is counted."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm.config import KVTransferConfig  # noqa: E402

from kvguard.adapters.vllm.config import GuardConfigError  # noqa: E402
from kvguard.adapters.vllm.exits import handoff  # noqa: E402
from kvguard.adapters.vllm.exits.gate import LOAD_SEALS  # noqa: E402
from kvguard.adapters.vllm.workers import seals as worker_seals  # noqa: E402
from kvguard.adapters.vllm.workers.audit import with_seals  # noqa: E402

from .harness import make_scheduler  # noqa: E402
from .test_connector_gate import _prefill, needs_nixl  # noqa: E402
from .test_worker_audit import _cache, _runner  # noqa: E402


def _sealed_prefill(s: Any) -> tuple[str, dict[str, Any] | None]:
    """``_prefill``'s clean request, its step's blocks sealed by the played workers."""
    schedule = s.schedule

    def sealing_schedule(*args: Any, **kwargs: Any) -> Any:
        so = schedule(*args, **kwargs)
        s._kvguard_test_seal = getattr(so, worker_seals.SEAL_FIELD, {})
        return so

    update = s.update_from_output

    def sealed_update(so: Any, mo: Any) -> Any:
        blocks = s._kvguard_test_seal
        seals = {b: 1000 + b for ids in blocks.values() for b in ids}
        mo.num_nans_in_logits = with_seals(mo.num_nans_in_logits, seals)
        return update(so, mo)

    s.schedule, s.update_from_output = sealing_schedule, sealed_update
    return _prefill(s, "clean", "clean")


@needs_nixl
def test_the_prefill_side_hands_over_each_blocks_seal() -> None:
    config = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")
    s = make_scheduler(kvguard={"seal": True}, kv_transfer_config=config)
    reason, params = _sealed_prefill(s)
    assert reason == "length" and params is not None
    (blocks,) = params["remote_block_ids"]
    assert params[handoff.HANDOFF_SEALS] == [[1000 + b for b in blocks]]  # 3 full blocks
    off = make_scheduler(kv_transfer_config=config)
    _, plain = _prefill(off, "clean", "clean")
    assert plain is not None and handoff.HANDOFF_SEALS not in plain


def test_reads_expect_their_seals_paired_from_the_end() -> None:
    """The decode side's local blocks of a read, paired with the handed-over seals from
    the end (a local prefix hit leaves fewer local blocks); no seal: refused (None);
    the producer's None (its partial last block): not verified."""
    read = SimpleNamespace(local_block_ids=[[7, 8, 9]])
    unsealed = SimpleNamespace(local_block_ids=[[4]])
    meta = SimpleNamespace(reqs_to_recv={"a": read, "b": unsealed})
    requests = {
        "a": SimpleNamespace(kv_transfer_params={handoff.HANDOFF_SEALS: [[11, 12, 13, None]]}),
        "b": SimpleNamespace(kv_transfer_params={}),
    }
    covered = handoff.expect_handoff_seals(meta, requests)
    assert covered == {"a": {7, 8, 9}, "b": {4}}
    assert getattr(meta, LOAD_SEALS) == {"a": {7: 12, 8: 13}, "b": {4: None}}


def test_the_workers_refuse_a_read_that_does_not_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    """The patch of vLLM's NixlConnector (worker side), on a stand-in class: a read
    reported done is sealed; its blocks that differ fail to load, once."""

    class Results(SimpleNamespace):
        pass

    class Base:
        def bind_connector_metadata(self, meta: Any) -> None:
            self.meta = meta

        def get_transfer_results(self, finished: set[str]) -> Any:
            return Results(finished_recving={"a", "c"}, finished_sending=set())

        def get_block_ids_with_load_errors(self) -> set[int]:
            return {99}

    class KVConnectorBase_V1:
        pass

    class NixlConnector(Base, KVConnectorBase_V1):
        pass

    module = ModuleType("nixl_stand_in")
    module.NixlConnector = NixlConnector  # type: ignore[attr-defined]
    handoff._patch_nixl(module)
    runner = _runner()
    monkeypatch.setattr(worker_seals, "_process_runner", [runner])
    good = worker_seals.seal_step(runner, {"a": [1, 2]})
    _cache(runner, 1)[0, 2, 1, 0, 0] = 3.5  # block 2 rots
    connector = NixlConnector()
    meta = SimpleNamespace()
    setattr(meta, LOAD_SEALS, {"a": good, "b": {5: 1}})
    connector.bind_connector_metadata(meta)
    connector.get_transfer_results(set())
    assert connector.get_block_ids_with_load_errors() == {2, 99}
    assert connector.get_block_ids_with_load_errors() == {99}  # reported once
    assert connector.__dict__["_kvguard_loads"].expected == {"b": {5: 1}}  # still reading


@needs_nixl
def test_a_refused_read_is_counted_and_a_multi_group_model_refused() -> None:
    config = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")
    s = make_scheduler(kvguard={"seal": True}, kv_transfer_config=config)
    s._kvguard_handoffs.update({"a": {3, 4}, "b": {5}})
    s._kvguard_count_refused_handoffs(
        SimpleNamespace(invalid_block_ids={4}, finished_recving={"a", "b"})
    )
    assert s.kvguard_stats()["handoffs_refused"] == 1 and s._kvguard_handoffs == {}
    with pytest.raises(GuardConfigError, match="one KV cache group"):
        make_scheduler(
            kvguard={"seal": True}, groups=("full", "sliding"), kv_transfer_config=config
        )
