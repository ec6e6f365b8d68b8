"""The shared-storage gate: vLLM's ExampleConnector (its real scheduler side, and its
real worker-side save, called here as the forward would) makes a store visible only
once the step that wrote it validated, deletes one whose step failed, deletes a folder
whose loaded KV failed the step computing on it, and purges a folder holding an
invalidated hash. The real-engine prefill/decode tests (tests/e2e/test_connectors.py)
run the same connector between two engines.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (  # noqa: E402
    ExampleConnector,
)
from vllm.v1.request import RequestStatus  # noqa: E402

from kvguard.adapters.vllm import plugin  # noqa: E402
from kvguard.adapters.vllm.config import GuardConfigError  # noqa: E402
from kvguard.adapters.vllm.exits.example_connector import TIER, GuardedExampleConnector  # noqa: E402

from .harness import BLOCK, make_request, make_scheduler, model_output  # noqa: E402
from .plugin_patches import undo_plugin_patches_after  # noqa: E402

PROMPT = list(range(100, 100 + 3 * BLOCK + 4))
"""Three full blocks and a partial one: the connector stores the full ones."""
STORED = 3 * BLOCK
LAYER = "model.layers.0.self_attn.attn"


def _config(storage: Path, *, guarded: bool = True, multi: bool = False) -> KVTransferConfig:
    child: dict[str, Any] = {
        "kv_connector": "GuardedExampleConnector" if guarded else "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    if guarded:
        child["kv_connector_module_path"] = "kvguard.adapters.vllm"
    if multi:
        return KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"connectors": [child]},
        )
    return KVTransferConfig(**child)


class Engine:
    """A scheduler with the connector, and the worker side of it: each step's forward
    writes the KV cache (one layer, each slot's value its step's number) and saves
    what the step's connector metadata says, as vLLM's model runner calls it."""

    def __init__(self, storage: Path, *, guarded: bool = True, multi: bool = False) -> None:
        self.s = make_scheduler(
            guarded=guarded,
            kv_transfer_config=_config(storage, guarded=guarded, multi=multi),
            max_num_batched_tokens=256,
        )
        cls = GuardedExampleConnector if guarded else ExampleConnector
        self.worker = cls(self.s.vllm_config, KVConnectorRole.WORKER, self.s.kv_cache_config)
        blocks = self.s.kv_cache_config.num_blocks
        self.kv = torch.zeros(blocks, 1, BLOCK, 8)
        self.steps = 0

    def step(self, nans: dict[str, int] | None = None, unchecked: str | None = None) -> Any:
        so = self.s.schedule()
        self.steps += 1
        meta = so.kv_connector_metadata
        if hasattr(meta, "metadata"):  # inside a MultiConnector
            meta = meta.metadata[0]
        self.worker.bind_connector_metadata(meta)
        self.worker.save_kv_layer(LAYER, self.kv, attn_metadata=object())
        self.worker.clear_connector_metadata()
        mo = model_output(self.s, so, nans)
        if unchecked is not None:
            del mo.num_nans_in_logits[unchecked]
        return self.s.update_from_output(so, mo)

    def run(self, request_id: str, prompt: list[int], max_tokens: int = 1, **step: Any) -> Any:
        self.s.add_request(make_request(request_id, prompt, max_tokens=max_tokens))
        out = self.step(**step)
        while request_id in self.s.requests:
            out = self.step()
        return out

    def hit(self, prompt: list[int]) -> int:
        """Tokens the connector would load for a new request with ``prompt``."""
        connector = self.s.connector
        if hasattr(connector, "_connectors"):
            connector = connector._connectors[0]
        tokens, _ = connector.get_num_new_matched_tokens(make_request("probe", prompt), 0)
        return int(tokens or 0)


def _listing(storage: Path) -> list[str]:
    return sorted(os.listdir(storage))


@pytest.fixture
def storage(tmp_path: Path) -> Path:
    return tmp_path


@pytest.mark.parametrize("multi", [False, True], ids=["alone", "multi"])
def test_a_clean_store_is_committed_after_its_step(storage: Path, multi: bool) -> None:
    e = Engine(storage, multi=multi)
    e.run("a", PROMPT)
    (folder,) = _listing(storage)
    assert ".kvguard-" not in folder
    assert sorted(os.listdir(storage / folder)) == [f"{LAYER}.safetensors"]
    assert e.hit(PROMPT) == STORED
    pool = e.s.kvguard_pool
    ids = pool.core.prefix_index
    assert all(TIER in pool.core.tier_copies(h) for h in ids)
    assert e.s.kvguard_stats()["storage_stores_committed"] == 1


def test_a_failed_step_s_store_is_never_visible(storage: Path) -> None:
    e = Engine(storage)
    e.run("a", PROMPT, nans={"a": 1})
    assert _listing(storage) == [] and e.hit(PROMPT) == 0
    assert e.s.kvguard_stats()["storage_stores_discarded"] == 1


def test_stock_vllm_stores_the_failed_step(storage: Path) -> None:
    """The same on stock vLLM: the failed step's KV is on the storage, a hit for any
    instance that reads it."""
    e = Engine(storage, guarded=False)
    e.run("a", PROMPT, nans={"a": 1})
    assert len(_listing(storage)) == 1 and e.hit(PROMPT) == STORED


def test_a_store_waits_for_a_counted_step(storage: Path) -> None:
    """A step without a NaN count: the store stays staged (no lookup finds it) until
    the request's next step, counted clean, vouches for the blocks."""
    e = Engine(storage)
    e.s.add_request(make_request("a", PROMPT, max_tokens=3))
    e.step(unchecked="a")
    (staged,) = _listing(storage)
    assert ".kvguard-" in staged and e.hit(PROMPT) == 0
    e.step()
    (folder,) = _listing(storage)
    assert ".kvguard-" not in folder and e.hit(PROMPT) == STORED


def test_loaded_kv_whose_step_fails_is_deleted(storage: Path) -> None:
    """A stock instance's NaN store, loaded here: the step computing on it fails, the
    request ends with an error and the folder goes (the next reader misses)."""
    Engine(storage, guarded=False).run("a", PROMPT, nans={"a": 1})
    e = Engine(storage)
    assert e.hit(PROMPT) == STORED
    out = e.run("b", PROMPT, nans={"b": 1})
    (finished,) = [o for eco in out.values() for o in eco.outputs if o.finish_reason]
    assert str(finished.finish_reason) == "error"
    assert _listing(storage) == [] and e.hit(PROMPT) == 0
    assert e.s.kvguard_stats()["storage_folders_purged"] == 1


def test_loaded_kv_that_validates_is_recorded_as_a_tier_copy(storage: Path) -> None:
    Engine(storage).run("a", PROMPT)
    e = Engine(storage)
    e.run("b", PROMPT)
    pool = e.s.kvguard_pool
    assert [TIER in pool.core.tier_copies(h) for h in pool.core.prefix_index] == [True] * 3


def test_invalidation_purges_the_folder(storage: Path) -> None:
    e = Engine(storage)
    e.run("a", PROMPT)
    other = list(range(5000, 5000 + 2 * BLOCK + 4))
    e.run("b", other)
    assert len(_listing(storage)) == 2
    report = e.s.kvguard_invalidate_tokens(PROMPT[:BLOCK])  # the first block, and after
    assert len(report.purged[TIER]) == 3 and report.copies_purged == 3
    assert len(_listing(storage)) == 1 and e.hit(PROMPT) == 0 and e.hit(other) == 2 * BLOCK
    assert e.s.kvguard_stats()["tier_copies_purged"] == 3


def test_without_the_purger_the_folder_stays(storage: Path) -> None:
    """What the purger is for: unregistered, the invalidation drops kvguard's record
    but the storage keeps serving the corrupt KV."""
    e = Engine(storage)
    e.run("a", PROMPT)
    e.s.kvguard_pool.tier_purgers._purgers.clear()
    report = e.s.kvguard_invalidate_tokens(PROMPT)
    assert report.copies_purged == 0 and len(report.unpurged) == 3
    assert e.hit(PROMPT) == STORED


def test_prefix_caching_off_is_refused(storage: Path) -> None:
    with pytest.raises(GuardConfigError, match="prefix caching"):
        make_scheduler(kv_transfer_config=_config(storage), prefix_caching=False)


@pytest.fixture
def plugin_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    undo_plugin_patches_after(monkeypatch)
    monkeypatch.setenv("KVGUARD_GUARD", "1")
    plugin.register()
    yield


@pytest.mark.usefixtures("plugin_on")
def test_the_plugin_substitutes_the_guarded_connector(storage: Path) -> None:
    stock = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(stock) is GuardedExampleConnector
    e = Engine(storage, guarded=False)  # vLLM's name, through the plugin's factory
    assert type(e.s.connector) is GuardedExampleConnector


def test_a_store_whose_request_left_before_its_verdict_is_never_committed(
    storage: Path,
) -> None:
    """A's step comes back without a NaN count (its store waits), then its client
    aborts it; b, with the same prompt, gets the same block ids and validates them
    under the same hashes. A's staged KV must not be what goes in place (the blocks'
    generation in kvguard's pool tells that they were released in between)."""
    e = Engine(storage)
    s = e.s
    s.add_request(make_request("a", PROMPT, max_tokens=3))
    so = s.schedule()
    e.worker.bind_connector_metadata(so.kv_connector_metadata)
    e.kv.fill_(1.0)  # a's KV, never validated
    e.worker.save_kv_layer(LAYER, e.kv, attn_metadata=object())
    e.worker.clear_connector_metadata()
    mo = model_output(s, so)
    del mo.num_nans_in_logits["a"]
    s.update_from_output(so, mo)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    s.add_request(make_request("b", PROMPT, max_tokens=3))
    so = s.schedule()
    e.worker.bind_connector_metadata(so.kv_connector_metadata)
    e.kv.fill_(2.0)  # b's KV, clean
    e.worker.save_kv_layer(LAYER, e.kv, attn_metadata=object())
    e.worker.clear_connector_metadata()
    s.update_from_output(so, model_output(s, so))
    (folder,) = [name for name in _listing(storage) if ".kvguard-" not in name]
    # (safetensors comes with vLLM, as the connector writes its files with it.)
    load_file = importlib.import_module("safetensors.torch").load_file
    kv = load_file(str(storage / folder / f"{LAYER}.safetensors"))["kv_cache"]
    assert kv.unique().tolist() == [2.0], "the storage serves a's never-validated KV"


def test_a_negative_external_hit_counts_as_none(storage: Path) -> None:
    """vLLM's count is the folder's tokens minus the local hit; a local hit past the
    folder would make it negative, and the scheduler recompute inside published
    blocks."""
    e = Engine(storage)
    e.run("a", PROMPT)  # a folder of three blocks
    request = make_request("b", PROMPT)  # (a local hit of four blocks: a resumed request)
    tokens, _ = e.s.connector.get_num_new_matched_tokens(request, 4 * BLOCK)
    assert tokens == 0
