"""Prefill/decode over NIXL on real engines: vLLM's ``NixlConnector`` between two CPU
engines on loopback, its UCX backend moving KV between their CPU KV caches.

As vLLM's disaggregated-serving proxy runs it: a prefill instance
(``kv_role="kv_producer"``) computes a prompt for one token, sent with
``kv_transfer_params={"do_remote_decode": True}``; its ``request_finished`` keeps the
request's blocks and hands the client the parameters (``do_remote_prefill``, its
block ids, engine id and side channel) that a decode instance (``kv_consumer``), sent
the prompt with them, uses to read the blocks over NIXL and decode on. Stock vLLM's
prefill instance hands over whatever its forward wrote, NaN included. Under kvguard
only a request that ended after clean, counted steps is handed to the connector
(``kvguard.adapters.vllm.exits.gate``): a request whose step had NaN logits ends
with an error, one whose last step came back without a NaN count ends normally, and
neither gets transfer parameters -- the decode instance computes such a prompt itself.

Every engine runs in processes of its own (vLLM keeps a process's KV connector in a
process-wide global) and listens on a side-channel port of its own
(``VLLM_NIXL_SIDE_CHANNEL_PORT``, read by the engine core and its worker). The decode
instance is stock with its model's faults off: what it computes itself is fault-free,
so any NaN it meets was read from the prefill instance. Prompts fit one prefill step
(``max_num_batched_tokens`` 256).
"""

from __future__ import annotations

import importlib.util
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from .conftest import HAVE_ENGINE, SKIP_REASON

HAVE_NIXL = importlib.util.find_spec("nixl") is not None

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not HAVE_ENGINE, reason=SKIP_REASON),
    pytest.mark.skipif(not HAVE_NIXL, reason="needs NIXL (pip install nixl)"),
]

if HAVE_ENGINE:
    from .conftest import shutdown
    from .engine import (
        Result,
        connector_engine,
        generate,
        result,
        set_faults,
        tokens,
        trigger,
        with_token,
    )

PROMPT = 100
"""Prompt length: one prefill step; the decode instance reads all of it (vLLM's NIXL
connector loads every prompt token of a dense-attention model)."""

TO_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}
"""What a proxy sends the prefill instance (vLLM's toy proxy adds None for the rest)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _engine(model_dir: str, guard: bool, role: str, log: Path) -> Any:
    from vllm.config import KVTransferConfig

    # The CPU platform's NIXL takes only a CPU buffer: the KV cache itself is
    # registered with NIXL (DRAM), no host copy. UCX is the connector's default backend.
    config = KVTransferConfig(kv_connector="NixlConnector", kv_role=role, kv_buffer_device="cpu")
    side_channel = {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port()),
    }
    return connector_engine(model_dir, guard, config, log, side_channel)


@pytest.fixture(scope="module")
def instances(
    model_dir: str, reference: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """Prefill instances (stock, guarded) and a stock decode instance, faults off."""
    logs = tmp_path_factory.mktemp("nixl-logs")
    built: dict[str, Any] = {}
    try:
        for name, guard, role in [
            ("prefill-stock", False, "kv_producer"),
            ("prefill-guarded", True, "kv_producer"),
            ("decode", False, "kv_consumer"),
        ]:
            built[name] = _engine(model_dir, guard, role, logs / f"{name}.log")
        set_faults(built["decode"], False)
        built["logs"] = logs
        yield built
    finally:
        for name, llm in built.items():
            if name != "logs":
                shutdown(llm)


def _log(instances: dict[str, Any], name: str) -> str:
    return (instances["logs"] / f"{name}.log").read_text(errors="replace")


def _run(
    llm: Any, prompts: Sequence[Sequence[int]], params: Sequence[dict[str, Any] | None], n: int
) -> list[tuple[Result, dict[str, Any] | None]]:
    """Greedy generation of ``prompts`` submitted together, each with its own
    ``kv_transfer_params`` (None: none): each request's result and the transfer
    parameters the client got back."""
    from vllm import SamplingParams, TokensPrompt

    sampling = [
        SamplingParams(
            temperature=0,
            max_tokens=n,
            ignore_eos=True,
            extra_args=None if p is None else {"kv_transfer_params": dict(p)},
        )
        for p in params
    ]
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sampling, use_tqdm=False
    )
    return [(result(o), o.kv_transfer_params) for o in outs]


def _to_decode(params: dict[str, Any] | None) -> dict[str, Any]:
    """The prefill instance's transfer parameters, as the proxy forwards them.

    Less ``remote_prefill_cached_tokens``: given it, vLLM reports the prefill
    instance's own prefix hit as the decode request's ``num_cached_tokens``; without
    it, the decode instance's (local plus loaded), which shows the KV was read."""
    assert params is not None and params["do_remote_prefill"], params
    return {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}


def _drop_nan_counts(worker: Any, drop: bool) -> None:
    """In the worker: its steps report no NaN counts (``num_nans_in_logits`` empty,
    what vLLM's runner returns when counting fails) while ``drop``."""
    runner = worker.model_runner
    v1 = hasattr(type(runner), "_get_nans_in_logits")  # 0.32: V1 counts there
    method = "_get_nans_in_logits" if v1 else "sample_tokens"  # 0.34's CPU runner: output
    if not drop:
        runner.__dict__.pop(method, None)
    elif v1:
        runner._get_nans_in_logits = lambda logits: {}
    else:
        stock = type(runner).sample_tokens

        def sample_tokens(*args: Any, **kwargs: Any) -> Any:
            output = stock(runner, *args, **kwargs)
            if output is not None:
                output.num_nans_in_logits = {}
            return output

        runner.sample_tokens = sample_tokens


def _prompts(seed: int, fault_at: int) -> tuple[list[int], list[int]]:
    """A clean prompt and one whose prefill step hits a NaN at position ``fault_at``
    (each test its own: an engine's model fires a fault once per position)."""
    clean = tokens(seed, PROMPT)
    bad = with_token(tokens(seed + 1, PROMPT), fault_at, trigger())
    return clean, bad


@pytest.mark.parametrize("prefill", ["stock", "guarded"])
def test_prefill_decode_over_nixl_hands_over_validated_kv_only(
    prefill: str, instances: dict[str, Any], reference: Any
) -> None:
    """The clean prompt's KV is read by the decode instance over NIXL (a hit of the
    whole prompt) and decodes to the fault-free output, stock or guarded. The prompt
    whose prefill step hits a NaN: stock hands it over like any other, and the decode
    instance, reading the NaN KV, decodes garbage; guarded, the request fails on the
    prefill instance with no transfer parameters, so nothing is read, and the decode
    instance -- sent the prompt without them -- computes it itself: fault-free.

    (vLLM's NixlConnector itself sends nothing of a request that did not end normally:
    here it is the guard failing the request that keeps its KV home. The
    request-finished gate proper is the next test's.)"""
    clean, bad = _prompts(111, 40) if prefill == "stock" else _prompts(121, 45)
    want = generate(reference, [clean, bad], max_tokens=8)
    first = _run(instances[f"prefill-{prefill}"], [clean, bad], [TO_DECODE, TO_DECODE], 1)
    (ok, ok_params), (failed, failed_params) = first
    assert ok == Result(want[0].token_ids[:1], "length", 0)
    handed: list[dict[str, Any] | None]
    if prefill == "stock":
        assert failed.finish_reason == "length"
        handed = [_to_decode(ok_params), _to_decode(failed_params)]
    else:
        assert failed.finish_reason == "error"
        assert failed_params is None  # nothing to read: the proxy sends the prompt alone
        handed = [_to_decode(ok_params), None]
    decoded = _run(instances["decode"], [clean, bad], handed, 8)
    assert decoded[0][0] == Result(want[0].token_ids, "length", PROMPT)  # read over NIXL
    if prefill == "stock":
        # Handed over: the decode instance read the NaN KV and decoded from it (greedy
        # over NaN logits: token 0, every step).
        assert decoded[1][0].num_cached_tokens == PROMPT
        assert decoded[1][0].token_ids != want[1].token_ids
    else:
        assert decoded[1][0] == Result(want[1].token_ids, "length", 0)  # computed afresh
        log = _log(instances, "prefill-guarded")
        assert "connectors gated: NixlPullConnector (at request_finished);" in log


@pytest.mark.parametrize("prefill", ["stock", "guarded"])
def test_a_prefill_step_without_a_nan_count_is_not_handed_over(
    prefill: str, instances: dict[str, Any], reference: Any
) -> None:
    """A prefill step that comes back without a NaN count (the prefill instance's
    counting fails): its KV may be fine, but no one checked it. The request ends
    normally either way. Stock hands it over; guarded, the connector is shown the
    request as aborted -- no transfer parameters, its blocks not held for a reader --
    and the decode instance computes the prompt itself."""
    prompt = tokens(131 if prefill == "stock" else 141, PROMPT)
    (want,) = generate(reference, [prompt], max_tokens=8)
    llm = instances[f"prefill-{prefill}"]
    llm.collective_rpc(_drop_nan_counts, args=(True,))
    try:
        ((first, params),) = _run(llm, [prompt], [TO_DECODE], 1)
    finally:
        llm.collective_rpc(_drop_nan_counts, args=(False,))
    assert first == Result(want.token_ids[:1], "length", 0)
    if prefill == "stock":
        ((decoded, _),) = _run(instances["decode"], [prompt], [_to_decode(params)], 8)
        assert decoded == Result(want.token_ids, "length", PROMPT)  # read over NIXL
    else:
        assert params is None
        ((decoded, _),) = _run(instances["decode"], [prompt], [None], 8)
        assert decoded == Result(want.token_ids, "length", 0)  # computed afresh
        assert "its KV is not handed to the KV connector" in _log(instances, "prefill-guarded")
