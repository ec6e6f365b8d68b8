"""The guard behind vLLM's OpenAI-compatible server on 127.0.0.1, driven over HTTP
(the completions API with prompt token ids; :mod:`tests.e2e.server`), stock and
guarded side by side.

What a client sees of a request the guard finishes with reason "error" is vLLM's own
mapping of that reason: a non-streaming completion is answered HTTP 500
``InternalServerError``; a streaming one delivers the tokens sampled before the
fault, then an error event instead of more tokens. What an operator sees is the
server's log: kvguard's start-up line and one warning per aborted request.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import HAVE_ENGINE, SKIP_REASON

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not HAVE_ENGINE, reason=SKIP_REASON)]

if HAVE_ENGINE:
    from .engine import BLOCK_ZEROING, SERIES, generate, tokens, trigger, with_token
    from .server import ERROR_BODY, Server, server_env, serving, start


@pytest.fixture(scope="module")
def servers(
    model_dir: str, reference: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Server]]:
    logs = tmp_path_factory.mktemp("serve-logs")
    with serving(
        *(
            functools.partial(start, name, model_dir, str(logs / f"{name}.log"), server_env(guard))
            for name, guard in (("stock", False), ("guarded", True))
        )
    ) as (stock, guarded):
        yield {"stock": stock, "guarded": guarded}


def test_the_guarded_engine_logs_one_start_up_line_and_stock_none(
    servers: dict[str, Server],
) -> None:
    """One INFO line from the engine core: the guard in force, the vLLM found, the
    one worker the engine core checked, the zero policy, no connector, the one KV
    cache group. Stock (the plugin loaded, the guard not asked for): no kvguard line."""
    (line,) = servers["guarded"].log_lines("kvguard: guard in force")
    assert re.search(
        rf"^\(EngineCore\S* pid=\d+\) INFO .* kvguard: guard in force \(vLLM 0\.{SERIES[1]}\.\S+, "
        rf"series 0\.{SERIES[1]}, GuardedScheduler\): workers checked: 1 OK; zero policy: "
        rf"suspect \(block zeroing: {re.escape(BLOCK_ZEROING)}\); KV audit: off; seals: off; "
        r"prefix caching: on; connectors gated: none; KV cache groups guarded: 1 "
        r"\(FullAttentionSpec\)$",
        line,
    ), line
    assert not servers["stock"].log_lines("kvguard:")


def _client_id(engine_request_id: str) -> str:
    """The id the client sees (``cmpl-<hex>``) of the engine's request id
    (``cmpl-<hex>-<prompt index>-<vLLM's 8 hex digits>``)."""
    return engine_request_id.rsplit("-", 2)[0]


def test_error_finish_reason_reaches_the_http_client(
    reference: Any, servers: dict[str, Server]
) -> None:
    """NaN in A's second prefill chunk. Stock answers 200 with 8 tokens sampled from
    NaN logits and finish reason "length"; guarded answers 500 InternalServerError
    (vLLM's answer to finish reason "error"), and B, sent next with A's first 128
    tokens, gets exactly the fault-free output."""
    a = with_token(tokens(201, 150), 80, trigger(0))
    b = a[:128] + tokens(202, 20)
    ref_a, ref_b = generate(reference, [a, b])

    status, body = servers["stock"].complete(a)
    assert status == 200
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["token_ids"] != list(ref_a.token_ids)
    status, body = servers["stock"].complete(b)
    assert body["choices"][0]["token_ids"] != list(ref_b.token_ids)

    guarded = servers["guarded"]
    seen = len(guarded.log_lines("kvguard: aborted"))
    status, body = guarded.complete(a)
    assert status == 500, body
    assert body == ERROR_BODY  # no choices, no id
    (abort,) = guarded.new_aborts(seen)
    assert (abort["start"], abort["end"], abort["prompt"], abort["output"]) == (
        "64",
        "127",
        "150",
        "0",
    )
    assert int(abort["nans"]) > 0
    # The operator's link from kvguard's line to the request: the API server's error
    # line names the client's id.
    client_id = _client_id(abort["request"])
    assert guarded.log_lines(f"Request {client_id} failed with an internal error")
    status, body = servers["guarded"].complete(b)
    assert status == 200
    assert body["choices"][0]["token_ids"] == list(ref_b.token_ids)
    assert body["choices"][0]["finish_reason"] == "length"


def test_streaming_delivers_the_tokens_before_the_fault_then_the_error(
    reference: Any, servers: dict[str, Server]
) -> None:
    """NaN in decode (position 43 of a 40-token prompt: output token 4). Streaming,
    stock sends all 8 tokens, 4.. from NaN logits; guarded sends at most tokens 0..3,
    each equal to the fault-free output, then an error event, and nothing else.

    (At most: vLLM merges a request's streamed deltas that its server has not sent yet,
    and its server raises on an ``error`` finish before sending the tokens of that
    output -- on a loaded machine tokens 0..3 can reach the server merged into the
    final output and are dropped with it. The guarantee is that no token sampled from
    NaN logits is delivered.)"""
    d = with_token(tokens(210, 40), 5, trigger(38))  # 5 + 38 = 43
    (ref,) = generate(reference, [d])

    def streamed(events: list[Any]) -> tuple[list[int], list[Any], list[Any]]:
        ids = [t for e in events if "choices" in e for c in e["choices"] for t in c["token_ids"]]
        reasons = [c["finish_reason"] for e in events if "choices" in e for c in e["choices"]]
        errors = [e["error"] for e in events if "error" in e]
        return ids, [r for r in reasons if r is not None], errors

    ids, reasons, errors = streamed(servers["stock"].stream(d))
    assert ids[:4] == list(ref.token_ids[:4]) and ids[4:] != list(ref.token_ids[4:])
    assert reasons == ["length"] and not errors
    assert not servers["stock"].log_lines("kvguard:")

    guarded = servers["guarded"]
    seen = len(guarded.log_lines("kvguard: aborted"))
    events = guarded.stream(d)
    ids, reasons, errors = streamed(events)
    assert len(ids) <= 4 and ids == list(ref.token_ids[: len(ids)])
    assert errors == [ERROR_BODY["error"]]
    assert events[-1] == ERROR_BODY  # the last event before [DONE]; it has no id
    assert reasons == []
    # kvguard's line: the decode step at position 43, after 4 sampled tokens (what
    # the engine sampled, whether or not the server sent them all).
    (abort,) = guarded.new_aborts(seen)
    assert (abort["start"], abort["end"], abort["prompt"], abort["output"]) == (
        "43",
        "43",
        "40",
        "4",
    )
    assert {e["id"] for e in events if "id" in e} <= {_client_id(abort["request"])}
