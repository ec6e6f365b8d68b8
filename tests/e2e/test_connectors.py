"""KV leaving an engine through a connector, on real engines: prefill/decode over vLLM's
``ExampleConnector`` (shared storage), and a tier copy purged by invalidation.

Two instances share a storage folder, as vLLM's prefill/decode examples run it: a
prefill instance (``kv_role="kv_producer"``) computes each prompt and its connector
stores the prompt's KV; a decode instance (``kv_consumer``) finds the prompt there,
loads it and decodes. Stock vLLM's prefill instance stores what its forward wrote,
NaN included, and a decode instance serves it. Under kvguard the store of a step that
failed never becomes visible, and a decode instance that loads KV a step then finds
failing deletes it.

Every engine runs in processes of its own (vLLM's multiprocess engine): vLLM keeps a
process's KV connector in a process-wide global, so two engines with connectors --
or one with and one without -- cannot share a process. Prompts fit one prefill step
(``max_num_batched_tokens`` 256): vLLM's ``ExampleConnector`` stores only a prompt's
first chunk under the whole prompt's name.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import HAVE_ENGINE, SKIP_REASON

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not HAVE_ENGINE, reason=SKIP_REASON)]

if HAVE_ENGINE:
    from .conftest import shutdown
    from .engine import (
        BLOCK,
        Result,
        connector_engine,
        generate,
        set_faults,
        tokens,
        trigger,
        with_token,
    )

PROMPT = 100
"""Prompt length: its first 96 tokens (three blocks) are what the connector stores."""
if HAVE_ENGINE:
    STORED = (PROMPT - 1) // BLOCK * BLOCK


def _engine(model_dir: str, guard: bool, role: str, storage: Path, log: Path) -> Any:
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role=role,
        kv_connector_extra_config={"shared_storage_path": str(storage)},
    )
    return connector_engine(model_dir, guard, config, log)


@pytest.fixture(scope="module")
def storage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shared-storage")


@pytest.fixture(scope="module")
def instances(
    model_dir: str, reference: Any, storage: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """Prefill instances (stock, guarded) and decode instances (stock, guarded) on one
    storage folder; the decode instances' model faults are off: what they compute
    themselves is fault-free, so any NaN they meet was loaded."""
    logs = tmp_path_factory.mktemp("connector-logs")
    built: dict[str, Any] = {}
    try:
        for name, guard, role in [
            ("prefill-stock", False, "kv_producer"),
            ("prefill-guarded", True, "kv_producer"),
            ("decode-stock", False, "kv_consumer"),
            ("decode-guarded", True, "kv_consumer"),
        ]:
            built[name] = _engine(model_dir, guard, role, storage, logs / f"{name}.log")
        for name in ("decode-stock", "decode-guarded"):
            set_faults(built[name], False)
        built["logs"] = logs
        yield built
    finally:
        for name, llm in built.items():
            if name != "logs":
                shutdown(llm)


def _folders(storage: Path) -> set[str]:
    return set(os.listdir(storage))


def _prompts(seed: int, fault_at: int) -> tuple[list[int], list[int]]:
    """A clean prompt and one whose prefill step hits a NaN at position ``fault_at``
    (each test its own: an engine's model fires a fault once per position)."""
    clean = tokens(seed, PROMPT)
    bad = with_token(tokens(seed + 1, PROMPT), fault_at, trigger())
    return clean, bad


def _log(instances: dict[str, Any], name: str) -> str:
    return (instances["logs"] / f"{name}.log").read_text(errors="replace")


@pytest.mark.parametrize("prefill", ["stock", "guarded"])
def test_prefill_decode_hands_over_validated_kv_only(
    prefill: str, instances: dict[str, Any], reference: Any, storage: Path
) -> None:
    """The prefill instance's NaN step: stock stores it and the decode instance
    decodes from it (tokens sampled from NaN logits); guarded, the request fails on the
    prefill instance, nothing of it is stored, and the decode instance computes the
    prompt itself: its output is the fault-free one. The clean prompt is handed over
    (loaded, not recomputed) either way, with the fault-free output."""
    clean, bad = _prompts(11, 40) if prefill == "stock" else _prompts(21, 45)
    before = _folders(storage)
    first = generate(instances[f"prefill-{prefill}"], [clean, bad], max_tokens=1)
    want = generate(reference, [clean, bad], max_tokens=8)
    assert first[0].token_ids == want[0].token_ids[:1]
    stored = _folders(storage) - before
    assert not [f for f in stored if ".kvguard-" in f], "a staging folder was left"
    decoded = generate(instances["decode-stock"], [clean, bad], max_tokens=8)
    assert decoded[0] == Result(want[0].token_ids, "length", STORED)  # loaded
    if prefill == "stock":
        assert first[1].finish_reason == "length"
        assert len(stored) == 2
        # Handed over: the decode instance loaded the NaN KV and decoded garbage.
        assert decoded[1].num_cached_tokens == STORED
        assert decoded[1].token_ids != want[1].token_ids
    else:
        assert first[1].finish_reason == "error"
        assert len(stored) == 1  # the clean prompt's folder only
        assert decoded[1] == Result(want[1].token_ids, "length", 0)  # computed afresh
        log = _log(instances, "prefill-guarded")
        assert "connectors gated: GuardedExampleConnector;" in log


def test_a_guarded_decode_instance_drops_kv_that_fails_its_step(
    instances: dict[str, Any], reference: Any, storage: Path
) -> None:
    """KV loaded from the storage is not trusted until a step computing on it is
    counted clean: a stock prefill instance's NaN store, loaded by the guarded decode
    instance, fails that instance's step -- the request ends with an error, and the
    folder it came from is deleted (a cache miss for the next reader), so a retry
    computes the prompt afresh and gets the fault-free output."""
    _, bad = _prompts(31, 50)
    generate(instances["prefill-stock"], [bad], max_tokens=1)
    before = _folders(storage)
    (failed,) = generate(instances["decode-guarded"], [bad], max_tokens=8)
    assert failed.finish_reason == "error"
    assert len(before - _folders(storage)) == 1  # the poisoned folder is gone
    (want,) = generate(reference, [bad], max_tokens=8)
    (retried,) = generate(instances["decode-guarded"], [bad], max_tokens=8)
    assert retried == Result(want.token_ids, "length", 0)
    assert "failed computing on KV loaded from" in _log(instances, "decode-guarded")
    assert "aborted request" in _log(instances, "decode-guarded")


def test_invalidating_a_prefix_purges_its_stored_copy(
    instances: dict[str, Any], reference: Any, storage: Path
) -> None:
    """KV found corrupt after it was stored: ``kvguard_invalidate_tokens`` (an engine
    core utility) taints the prompt's blocks in the prefill instance -- its GPU copy
    leaves the prefix cache, quarantined -- and deletes the folder holding them: the
    prompt is then computed afresh (no hit, on the GPU or in the storage) and stored
    again. Stock vLLM has no such call."""
    clean = tokens(41, PROMPT)
    before = _folders(storage)
    generate(instances["prefill-guarded"], [clean], max_tokens=1)
    (folder,) = _folders(storage) - before
    core = instances["prefill-guarded"].llm_engine.engine_core
    report = core.call_utility("kvguard_invalidate_tokens", clean[:STORED])
    assert report["hashes"] == report["blocks_quarantined"] == STORED // BLOCK
    assert report["purged:vllm-example-storage"] == STORED // BLOCK
    assert folder not in _folders(storage)
    (want,) = generate(reference, [clean], max_tokens=1)
    (again,) = generate(instances["prefill-guarded"], [clean], max_tokens=1)
    assert again == Result(want.token_ids, "length", 0)
    assert folder in _folders(storage)
    with pytest.raises(Exception, match="kvguard_invalidate_tokens"):
        instances["prefill-stock"].llm_engine.engine_core.call_utility(
            "kvguard_invalidate_tokens", clean
        )
