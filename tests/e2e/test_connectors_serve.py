"""The shared-storage gate behind ``vllm serve`` (API server, engine core and worker in
processes of their own): ``--kv-transfer-config`` names vLLM's ``ExampleConnector``,
the plugin puts the gated one in its place. A prompt whose prefill step hits a NaN:
stock answers 200 and stores its KV for every reader of the storage; guarded answers
500 and stores nothing, says so in its start-up line and counts it on ``/metrics``.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import HAVE_ENGINE, SKIP_REASON

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not HAVE_ENGINE, reason=SKIP_REASON)]

if HAVE_ENGINE:
    from .engine import ENGINE_KWARGS, tokens, trigger, wait_for, with_token
    from .server import Server, server_env, serving, start

ABORTED = 'kvguard:requests_aborted_total{engine="0"}'
if HAVE_ENGINE:
    KW = dict(ENGINE_KWARGS, max_num_batched_tokens=256)
    """One prefill step per prompt (vLLM's example connector stores a first chunk only)."""


@pytest.fixture(scope="module")
def servers(
    model_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[Server, Path]]]:
    logs = tmp_path_factory.mktemp("serve-connector-logs")
    starts, storages = [], []
    for name, guard in (("stock", False), ("guarded", True)):
        storage = tmp_path_factory.mktemp(f"storage-{name}")
        config = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        }
        extra = ["--kv-transfer-config", json.dumps(config)]
        log = str(logs / f"{name}.log")
        starts.append(functools.partial(start, name, model_dir, log, server_env(guard), KW, extra))
        storages.append(storage)
    with serving(*starts) as (stock, guarded):
        yield {"stock": (stock, storages[0]), "guarded": (guarded, storages[1])}


def test_a_failed_prefill_is_answered_500_and_never_stored(
    servers: dict[str, tuple[Server, Path]], reference: Any
) -> None:
    clean = tokens(61, 100)
    bad = with_token(tokens(62, 100), 40, trigger())
    for name, (server, storage) in servers.items():
        status, body = server.complete(clean, max_tokens=1)
        assert status == 200, body
        assert len(os.listdir(storage)) == 1  # stored, both
        status, body = server.complete(bad, max_tokens=1)
        folders = os.listdir(storage)
        if name == "stock":
            assert status == 200 and len(folders) == 2  # the NaN step's KV, stored
        else:
            assert status == 500 and len(folders) == 1, (status, folders)
    guarded = servers["guarded"][0]
    (line,) = guarded.log_lines("guard in force")
    assert "connectors gated: GuardedExampleConnector;" in line
    # (The engine core sends its counters at most once a second, and when it idles.)
    metrics = wait_for(guarded.metrics, lambda m: m.get(ABORTED) == 1, timeout_s=10)
    assert metrics['kvguard:storage_stores_committed_total{engine="0"}'] == 1
    assert metrics['kvguard:storage_stores_discarded_total{engine="0"}'] == 1
    assert metrics[ABORTED] == 1
