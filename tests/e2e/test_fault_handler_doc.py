"""docs/vllm-reference.md's worked fault handler (``step_or_resume``), run as written on
the real CPU engine: the step computing an armed position writes garbage KV and fails;
the handler recovers, and both requests finish with exactly their fault-free outputs."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import HAVE_ENGINE, SKIP_REASON

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not HAVE_ENGINE, reason=SKIP_REASON)]

if HAVE_ENGINE:
    from kvguard_e2e_nan_model.model import InjectedFault

    from .conftest import guard_in_this_process, in_process, shutdown
    from .engine import ENGINE_KWARGS, arm_crash, crashes_fired, generate, tokens

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm-reference.md"


def _handler_from_the_docs() -> Any:
    """``step_or_resume`` from docs/vllm-reference.md, its two user parts filled in: the
    error a failed worker raises (the test model's injected fault) and the restart (none
    needed: the in-process worker lives on)."""
    text = DOC.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    (code,) = [block for block in blocks if "def step_or_resume" in block]
    namespace: dict[str, Any] = {
        "WorkerFailed": InjectedFault,
        "restart_failed_worker": lambda executor: None,
    }
    exec(compile(code, str(DOC), "exec"), namespace)  # the project's own docs
    return namespace["step_or_resume"]


@pytest.fixture(scope="module")
def guarded(model_dir: str) -> Iterator[Any]:
    from vllm import LLM

    with guard_in_this_process():
        with in_process():
            llm = LLM(model=model_dir, **ENGINE_KWARGS)
        yield llm
        shutdown(llm)


def test_the_documented_fault_handler_resumes_the_requests(reference: Any, guarded: Any) -> None:
    a, b = tokens(601, 150), tokens(602, 40)
    ref_b, ref_a = generate(reference, [b, a], max_tokens=6)
    core = guarded.llm_engine.engine_core.engine_core
    core.step_fn = functools.partial(_handler_from_the_docs(), core)
    arm_crash(guarded, [80])
    out_b, out_a = generate(guarded, [b, a], max_tokens=6)
    assert crashes_fired(guarded) == [80]
    assert (out_a.token_ids, out_b.token_ids) == (ref_a.token_ids, ref_b.token_ids)
    assert out_a.finish_reason == out_b.finish_reason == "length"
    stats = core.scheduler.kvguard_stats()
    assert (stats["requests_recovered"], stats["requests_aborted"]) == (2, 0)
