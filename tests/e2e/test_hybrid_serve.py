"""A hybrid model (gated-delta-net + attention) behind ``vllm serve``, stock and guarded
side by side: vLLM's multiprocess engine (API server, engine core, worker, each in a
process of its own, each loading kvguard's plugin), driven over HTTP.

The trace of vLLM issue #55766 in small: A's prompt carries a NaN past its second block,
B shares A's prompt beyond the fault, and then A is retried. Stock vLLM answers A with
tokens sampled from NaN logits, publishes A's state checkpoints taken after the fault,
and B resumes from that poisoned state (a hit past the fault) and streams garbage.
Guarded, A is answered with vLLM's internal error, the engine core logs the abort, B
hits exactly A's validated prefix and gets the fault-free output, and the retry too.
The in-process engine is tested in ``tests/e2e/test_hybrid.py``, with the cache's
tensors read.
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
    from .conftest import in_process, shutdown
    from .engine import (
        GDN_ENGINE_KWARGS,
        build_gdn_model,
        generate,
        set_faults,
        tokens,
        trigger,
        with_token,
    )
    from .server import ERROR_BODY, Server, server_env, serving, start

BLOCK = 96
"""The block size vLLM runs both groups with (GDN_ENGINE_KWARGS); chunks of 64 tokens,
cut where a block ends, so A's state checkpoints are at 96, 192 and 288."""
FAULT = 200
"""A's NaN trigger: in the step computing 192..255."""


def _prompts() -> tuple[list[int], list[int]]:
    """(A, B): A 300 tokens with its trigger; B A's first 288 tokens and 20 of its own."""
    a = with_token(tokens(301, 300), FAULT, trigger(0))
    return a, a[: 3 * BLOCK] + tokens(302, 20)


@pytest.fixture(scope="module")
def gdn_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_gdn_model(str(tmp_path_factory.mktemp("nan-qwen3-next-serve")))


@pytest.fixture(scope="module")
def gdn_reference(gdn_dir: str) -> Iterator[Any]:
    """A stock in-process engine of the hybrid with its faults off: the fault-free
    outputs."""
    from vllm import LLM

    with in_process():
        llm = LLM(model=gdn_dir, **GDN_ENGINE_KWARGS)
    set_faults(llm, False)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def servers(
    gdn_dir: str, gdn_reference: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Server]]:
    logs = tmp_path_factory.mktemp("hybrid-serve-logs")
    # The prompt's cached tokens in each answer's usage (B's hit).
    extra = ["--enable-prompt-tokens-details"]
    with serving(
        *(
            functools.partial(
                start,
                name,
                gdn_dir,
                str(logs / f"{name}.log"),
                server_env(guard),
                GDN_ENGINE_KWARGS,
                extra,
            )
            for name, guard in (("stock", False), ("guarded", True))
        )
    ) as (stock, guarded):
        yield {"stock": stock, "guarded": guarded}


def _answer(server: Server, prompt: list[int]) -> tuple[int, Any, list[int], int | None]:
    """(HTTP status, body, the tokens, the prompt's cached tokens) of a completion."""
    status, body = server.complete(prompt)
    if status != 200:
        return status, body, [], None
    (choice,) = body["choices"]
    details = body["usage"].get("prompt_tokens_details") or {}
    return status, body, choice["token_ids"], details.get("cached_tokens")


def test_the_guarded_engine_core_guards_both_groups(servers: dict[str, Server]) -> None:
    (line,) = servers["guarded"].log_lines("kvguard: guard in force")
    groups = re.search(r"KV cache groups guarded: 2 \((?P<specs>[^)]*)\)$", line)
    assert groups, line
    assert sorted(groups["specs"].split(", ")) == ["FullAttentionSpec", "MambaSpec"], line
    assert not servers["stock"].log_lines("kvguard:")


def test_stock_serves_the_poisoned_state_to_a_same_prefix_request(
    gdn_reference: Any, servers: dict[str, Server]
) -> None:
    a, b = _prompts()
    ref_a, ref_b = generate(gdn_reference, [a, b])
    stock = servers["stock"]
    status, _, a_tokens, _ = _answer(stock, a)
    assert status == 200 and a_tokens != list(ref_a.token_ids)
    status, _, b_tokens, cached = _answer(stock, b)
    assert status == 200
    assert cached == 3 * BLOCK > FAULT  # A's checkpoint at 288, after the fault
    assert b_tokens != list(ref_b.token_ids)


def test_guarded_answers_a_with_an_error_and_b_and_the_retry_with_clean_outputs(
    gdn_reference: Any, servers: dict[str, Server]
) -> None:
    a, b = _prompts()
    ref_a, ref_b = generate(gdn_reference, [a, b])
    guarded = servers["guarded"]
    seen = len(guarded.log_lines("kvguard: aborted"))
    status, body, _, _ = _answer(guarded, a)
    assert (status, body) == (500, ERROR_BODY)
    (abort,) = guarded.new_aborts(seen)
    assert (abort["start"], abort["end"], abort["prompt"]) == ("192", "255", "300")

    status, _, b_tokens, cached = _answer(guarded, b)
    assert status == 200
    assert cached == 2 * BLOCK  # A's validated prefix: its checkpoint at 192
    assert b_tokens == list(ref_b.token_ids)
    status, _, retry_tokens, cached = _answer(guarded, a)
    assert status == 200
    assert cached == 3 * BLOCK  # B's own checkpoint at 288, computed cleanly
    assert retry_tokens == list(ref_a.token_ids)

    metrics = guarded.metrics()
    assert metrics['kvguard:requests_aborted_total{engine="0"}'] == 1
    assert metrics['kvguard:blocks_quarantined_total{engine="0"}'] > 0
