"""The KV audit (``{"kvguard": {"audit": true}}``) in a real engine: NaN that lands in
the KV after attention read it leaves the step's logits finite; only a scan of the KV
the step filled sees it.

The fault is the test model's ``arm_late_nan``: after the forward computing position
63 -- the last token of a 64-token prompt, whose one prefill step fills blocks 0 and 1
-- NaN lands in the KV block holding it, in every layer. The request itself samples
its one token from finite logits and finishes. Three in-process engines run the same
trace: stock vLLM, kvguard without the audit, kvguard with it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import HAVE_ENGINE, SKIP_REASON

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not HAVE_ENGINE, reason=SKIP_REASON)]

if HAVE_ENGINE:
    from .conftest import guard_in_this_process, in_process, kvguard_log, shutdown
    from .engine import (
        ENGINE_KWARGS,
        arm_late_nan,
        generate,
        late_nan_blocks,
        matchable_blocks,
        non_finite_blocks,
        scheduler,
        tokens,
    )

AUDIT = {"kvguard": {"audit": True}}


@pytest.fixture(scope="module")
def engines(model_dir: str) -> Iterator[dict[str, Any]]:
    from vllm import LLM

    built: dict[str, Any] = {}
    logs: dict[str, list[logging.LogRecord]] = {}
    with in_process():
        built["stock"] = LLM(model=model_dir, **ENGINE_KWARGS)
    with guard_in_this_process():
        with in_process():
            built["guarded"] = LLM(model=model_dir, **ENGINE_KWARGS)
        with in_process(), kvguard_log() as logs["audited"]:
            built["audited"] = LLM(model=model_dir, additional_config=AUDIT, **ENGINE_KWARGS)
        built["start-up log"] = logs["audited"]
        yield built
        for name, llm in built.items():
            if name != "start-up log":
                shutdown(llm)


def test_nan_written_into_kv_after_attention_is_caught_only_by_the_audit(
    reference: Any, engines: dict[str, Any]
) -> None:
    """x (64 tokens, 1 output token) fills blocks 0 and 1 in one step; NaN lands in
    block 1 after attention read it, so x's logits are finite. Then y (x's prompt and
    20 more tokens) arrives.

    Stock and kvguard without the audit both publish the poisoned block, and y hits it:
    stock streams tokens sampled from NaN logits, kvguard catches y's NaN logits and
    ends y with an error. kvguard with the audit ends x instead
    (finish reason "error", its filled blocks quarantined and zeroed before reuse): y
    computes its prompt afresh and gets exactly its fault-free output, and no block
    anywhere holds NaN afterwards."""
    x = tokens(501, 64)
    y = x + tokens(502, 20)
    (ref_y,) = generate(reference, [y], max_tokens=4)
    for name in ("stock", "guarded", "audited"):
        llm = engines[name]
        before = scheduler(llm).kvguard_stats() if name == "audited" else {}
        arm_late_nan(llm, [63])
        (x_out,) = generate(llm, [x], max_tokens=1)
        (poisoned,) = late_nan_blocks(llm)[-1:]
        (y_out,) = generate(llm, [y], max_tokens=4)
        if name == "audited":
            assert x_out.finish_reason == "error", name
            assert y_out.token_ids == ref_y.token_ids
            assert y_out.finish_reason == "length"
            assert y_out.num_cached_tokens == 0
            assert not non_finite_blocks(llm)  # the poisoned block was zeroed for y
            stats = scheduler(llm).kvguard_stats()  # (counted since the engine started)
            assert stats["requests_failed_audit"] - before["requests_failed_audit"] == 1
            # The blocks x and y filled, no more.
            assert stats["blocks_audited"] - before["blocks_audited"] == 2 + 2
            continue
        # Missed: x finished clean, its poisoned block was published and served to y.
        assert x_out.finish_reason == "length", name
        assert poisoned in non_finite_blocks(llm) & matchable_blocks(llm), name
        if name == "stock":
            assert y_out.num_cached_tokens == 64
            assert y_out.token_ids != ref_y.token_ids  # sampled from NaN logits
            assert y_out.finish_reason == "length"
        else:
            assert y_out.finish_reason == "error"  # y hit it: its own logits went NaN


def test_the_log_says_the_audit_is_on_and_names_the_kv_as_the_cause(
    engines: dict[str, Any],
) -> None:
    """The start-up line says the KV audit is on; the abort line names the request, the
    positions its step computed, and the audit's finding (its logits were finite)."""
    (start,) = engines["start-up log"]
    assert "KV audit: on;" in start.getMessage()
    llm = engines["audited"]
    arm_late_nan(llm, [63 + 64])
    with kvguard_log() as records:
        (out,) = generate(llm, [tokens(503, 128)], max_tokens=1)
    assert out.finish_reason == "error"
    (abort,) = records
    assert abort.levelno == logging.WARNING
    assert re.fullmatch(
        r"kvguard: aborted request \S+ \(finish reason 'error'\): the step computing its "
        r"positions 64\.\.127 \(prompt 128 tokens, 0 output token\(s\)\) had NaN or "
        r"infinite KV in 1 block\(s\) it filled \(KV audit\); its logits were finite; its "
        r"tokens are not delivered, .*",
        abort.getMessage(),
    ), abort.getMessage()
