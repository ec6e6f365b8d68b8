"""The guard in vLLM's default multiprocess engine: the engine core and its worker run
in processes of their own (spawned), which load vLLM's plugins themselves -- kvguard's
(switched on by ``KVGUARD_GUARD=1`` in their environment) and the test model's. Stock
and guarded engines side by side, as a client sees them; the worker's KV tensors are
read through ``collective_rpc``. What an operator sees is the engine core's log
(kvguard's start-up line, one warning per aborted request): the engine core writes it
to its own stdout, which it inherits from this process while the engine is built.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import HAVE_ENGINE, SKIP_REASON

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not HAVE_ENGINE, reason=SKIP_REASON)]

if HAVE_ENGINE:
    from .conftest import shutdown
    from .engine import (
        BLOCK_ZEROING,
        ENGINE_KWARGS,
        Result,
        apply_env,
        engine_env,
        faults_fired,
        generate,
        model_name,
        non_finite_blocks,
        output_to,
        restore_env,
        tokens,
        trigger,
        wait_for,
        with_token,
    )


CORE_LOG: dict[str, Path] = {}
"""What each engine's processes (engine core, worker) write to their stdout and
stderr: this process's fds 1 and 2 while the engine was built, which they inherit."""


def _engine(model_dir: str, guard: bool, log: Path) -> Any:
    from vllm import LLM

    env = engine_env(guard)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    saved = apply_env(env)
    try:
        with output_to(log):
            llm = LLM(model=model_dir, **ENGINE_KWARGS)
    finally:
        restore_env(saved)
    if type(llm.llm_engine.engine_core).__name__ != "SyncMPClient":
        shutdown(llm)
        raise AssertionError(f"not vLLM's multiprocess engine: {llm.llm_engine.engine_core!r}")
    return llm


@pytest.fixture(scope="module")
def engines(
    model_dir: str, reference: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    logs = tmp_path_factory.mktemp("engine-core-logs")
    CORE_LOG.update(stock=logs / "stock.log", guarded=logs / "guarded.log")
    built = {"stock": _engine(model_dir, guard=False, log=CORE_LOG["stock"])}
    try:
        built["guarded"] = _engine(model_dir, guard=True, log=CORE_LOG["guarded"])
        yield built
    finally:
        for llm in built.values():
            shutdown(llm)


def _core_lines(name: str, needle: str = "kvguard:") -> list[str]:
    with open(CORE_LOG[name], errors="replace") as f:
        return [line.rstrip("\n") for line in f if needle in line]


def _wait_for_lines(name: str, needle: str, count: int, timeout_s: float = 10) -> list[str]:
    """The lines of engine ``name``'s log holding ``needle``, once there are ``count``
    of them (or the timeout passed). The engine core logs before it sends the step's
    outputs, but its writes are its own: the file may lag."""
    return wait_for(lambda: _core_lines(name, needle), lambda lines: len(lines) >= count, timeout_s)


def _shown(name: str) -> str:
    """Engine ``name``'s log for an assertion message: its kvguard lines and its end."""
    with open(CORE_LOG[name], errors="replace") as f:
        lines = f.read().splitlines()
    kvguard = [line for line in lines if "kvguard" in line]
    return "\n".join(
        [f"{name} engine's log ({CORE_LOG[name]}), its kvguard lines:", *kvguard]
        + ["... its last 30 lines:", *lines[-30:]]
    )


def test_the_engine_processes_run_the_test_model(engines: dict[str, Any]) -> None:
    for llm in engines.values():
        assert llm.apply_model(model_name) == ["NanLlamaForCausalLM"]


def test_nan_in_prefill_chunk_2_and_same_prefix_requests(
    reference: Any, engines: dict[str, Any]
) -> None:
    """As in-process: A's chunk 2 computes NaN; B (with A) and C (after A) share A's
    first 128 tokens. Stock delivers NaN-derived tokens for all three; guarded ends A
    with "error" and no token, and B and C get the fault-free output."""
    a = with_token(tokens(101, 158), 90, trigger(0))
    b = a[:128] + tokens(102, 30)
    c = a[:128] + tokens(103, 30)
    ref_a, ref_b, ref_c = generate(reference, [a, b, c])
    out = {}
    for name, llm in engines.items():
        a_out, b_out = generate(llm, [a, b])
        (c_out,) = generate(llm, [c])
        assert (90, trigger(0)) in faults_fired(llm), name
        out[name] = (a_out, b_out, c_out)

    a_out, b_out, c_out = out["stock"]
    assert a_out.finish_reason == "length" and a_out.token_ids != ref_a.token_ids
    assert b_out.num_cached_tokens == 128 and b_out.token_ids != ref_b.token_ids
    assert c_out.num_cached_tokens == 128 and c_out.token_ids != ref_c.token_ids

    a_out, b_out, c_out = out["guarded"]
    assert (a_out.token_ids, a_out.finish_reason) == ((), "error")
    assert b_out == Result(ref_b.token_ids, "length", 64)
    assert c_out == Result(ref_c.token_ids, "length", 128)


def test_retry_hits_exactly_the_validated_prefix(reference: Any, engines: dict[str, Any]) -> None:
    a = with_token(tokens(110, 150), 100, trigger(0))
    (ref,) = generate(reference, [a])
    retries = {}
    for name, llm in engines.items():
        (first,) = generate(llm, [a])
        assert first.token_ids != ref.token_ids, name
        (retries[name],) = generate(llm, [a])
    assert retries["stock"].num_cached_tokens == 128
    assert retries["stock"].token_ids != ref.token_ids
    assert retries["guarded"] == Result(ref.token_ids, "length", 64)


def test_no_nan_survives_in_the_kv_cache_once_reused(
    reference: Any, engines: dict[str, Any]
) -> None:
    """A fails in chunk 2 (two blocks of NaN KV in the worker's tensors). R then needs
    four new blocks. Guarded: kvguard reuses the quarantined blocks first and has the
    worker zero them, so afterwards no block of the whole KV cache holds a non-finite
    value. Stock: A's NaN blocks stay in its prefix cache, untouched."""
    a = with_token(tokens(120, 126), 70, trigger(0))
    r = tokens(121, 120)
    (ref_r,) = generate(reference, [r], max_tokens=4)
    for name, llm in engines.items():
        before = non_finite_blocks(llm)
        (a_out,) = generate(llm, [a], max_tokens=1)
        poisoned = non_finite_blocks(llm) - before
        assert len(poisoned) == 2, (name, poisoned)  # A's chunk-2 blocks, in the tensors
        (r_out,) = generate(llm, [r], max_tokens=4)
        assert r_out.token_ids == ref_r.token_ids, name
        left = non_finite_blocks(llm)
        if name == "stock":
            assert a_out.finish_reason == "length"
            assert poisoned & left  # its cached chunk-2 block
        else:
            assert a_out.finish_reason == "error"
            assert not left, left


CORE_PREFIX = re.compile(r"^\(EngineCore\S* pid=\d+\) INFO ")
"""How vLLM's logger starts a line of the engine core process."""
START_UP = re.compile(
    r"^\((?P<process>EngineCore\S*) pid=(?P<pid>\d+)\) INFO .* kvguard: guard in force "
    r"\(vLLM (?P<version>\S+), series (?P<series>\S+), GuardedScheduler\): workers "
    r"checked: 1 OK; zero policy: suspect \(block zeroing: (?P<zeroing>[^)]+)\); KV "
    r"audit: off; seals: off; prefix caching: on; connectors gated: none; KV cache groups "
    r"guarded: 1 "
    r"\(FullAttentionSpec\)$"
)
"""kvguard's start-up line, as the engine core logs it (vLLM's prefix, then the text)."""
ABORT = re.compile(
    r"^\((?P<process>EngineCore\S*) pid=(?P<pid>\d+)\) WARNING .* kvguard: aborted request "
    r"(?P<request>\S+) \(finish reason 'error'\): the step computing its positions "
    r"(?P<start>\d+)\.\.(?P<end>\d+) \(prompt (?P<prompt>\d+) tokens, (?P<output>\d+) "
    r"output token\(s\)\) had (?P<nans>\d+) NaN logit\(s\); its tokens are not delivered, "
    r"and its KV past its last validated step is quarantined \(never cached or offloaded, "
    r"zeroed before reuse\)$"
)
"""kvguard's warning for an aborted request, as the engine core logs it."""


def test_the_engine_core_logs_the_start_up_line_and_one_warning_per_abort(
    engines: dict[str, Any],
) -> None:
    """The guarded engine core logs one INFO line at start-up: the guard in force,
    the vLLM this process runs, the one worker it checked, the zero policy, no
    connector, the one KV cache group. A (NaN in its second prefill chunk, positions
    64..127) leaves one WARNING naming A's request id, its positions, its prompt and
    its NaN count; B, clean and submitted with A, is not named. Stock (the plugin
    loaded, the guard not asked for) logs no kvguard line at all."""
    import vllm
    from vllm import SamplingParams, TokensPrompt

    # Both logs hold the engine core's own lines (vLLM's): the capture works.
    for name in engines:
        core = [line for line in _core_lines(name, "") if CORE_PREFIX.match(line)]
        assert core, _shown(name)
    start_up = _wait_for_lines("guarded", "kvguard: guard in force", 1)
    assert len(start_up) == 1, _shown("guarded")
    starting = START_UP.search(start_up[0])
    assert starting, _shown("guarded")
    assert starting["version"] == vllm.__version__, _shown("guarded")
    assert starting["series"] == ".".join(vllm.__version__.split(".")[:2]), _shown("guarded")
    assert starting["zeroing"] == BLOCK_ZEROING, _shown("guarded")
    core_pid = int(starting["pid"])
    assert core_pid != os.getpid(), _shown("guarded")  # logged by the engine core process

    # NaN from position 80: chunk 2. (Each engine fires a trigger once per position:
    # no other test of the module arms position 80.)
    a = with_token(tokens(130, 150), 80, trigger(0))
    b = tokens(131, 40)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=a), TokensPrompt(prompt_token_ids=b)]
    for name, llm in engines.items():
        seen = len(_core_lines(name, "kvguard: aborted"))
        a_out, b_out = llm.generate(prompts, params, use_tqdm=False)
        assert b_out.outputs[0].finish_reason == "length", name
        assert (80, trigger(0)) in faults_fired(llm), name
        if name == "stock":
            assert a_out.outputs[0].finish_reason == "length"
            # The engine core logs a step's aborts before it sends the step's outputs.
            assert not _core_lines("stock"), _shown("stock")
            continue
        assert a_out.outputs[0].finish_reason == "error"
        new = _wait_for_lines(name, "kvguard: aborted", seen + 1)[seen:]
        assert len(new) == 1, _shown(name)
        abort = ABORT.search(new[0])
        assert abort, _shown(name)
        # vLLM's engine request id: the client's (RequestOutput.request_id) and 8 hex
        # digits of its own.
        assert re.fullmatch(re.escape(a_out.request_id) + r"-[0-9a-f]{8}", abort["request"]), (
            a_out.request_id,
            _shown(name),
        )
        assert (abort["start"], abort["end"], abort["prompt"], abort["output"]) == (
            "64",
            "127",
            "150",
            "0",
        ), _shown(name)
        assert int(abort["nans"]) > 0, _shown(name)
        assert int(abort["pid"]) == core_pid, _shown(name)
        named_b = _core_lines(name, f"request {b_out.request_id}-")
        assert not named_b, _shown(name)

    # One start-up line for the engine's lifetime.
    assert len(_core_lines("guarded", "kvguard: guard in force")) == 1, _shown("guarded")
