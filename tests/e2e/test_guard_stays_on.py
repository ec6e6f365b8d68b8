"""No silent off-switch, in a real engine: ``--additional-config '{"kvguard": {...}}'``
alone switches the guard on (no ``KVGUARD_GUARD`` in any environment), in the
in-process engine, the multiprocess engine and ``vllm serve``; the engine refuses to
start when the guard was asked for but is not in force in a worker; and kvguard's
counters reach the API server's ``/metrics``.

Every engine here is built with ``KVGUARD_GUARD`` and ``VLLM_COMPUTE_NANS_IN_LOGITS``
absent from its environment: the config must do everything. What the plugin patches
in this process when a config switches the guard on is undone after each in-process
engine (:func:`plugin_patches_undone`), so the session's other engines stay stock.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import HAVE_ENGINE, SKIP_REASON

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not HAVE_ENGINE, reason=SKIP_REASON)]

if HAVE_ENGINE:
    from .conftest import in_process, kvguard_log, shutdown
    from .engine import (
        ENGINE_KWARGS,
        ENV,
        Result,
        apply_env,
        faults_fired,
        generate,
        non_finite_blocks,
        restore_env,
        scheduler,
        tokens,
        trigger,
        with_token,
    )
    from .server import serving, start

GUARD_CONFIG: dict[str, dict[str, Any]] = {"kvguard": {}}
"""The whole of what a user gives: the guard with its default settings."""
UNSET = ("KVGUARD_GUARD", "VLLM_COMPUTE_NANS_IN_LOGITS")


@contextlib.contextmanager
def plugin_patches_undone() -> Iterator[pytest.MonkeyPatch]:
    """What the plugin changes in this process when an engine's config switches the
    guard on (vLLM classes, the environment, its own state) is put back on exit."""
    from vllm.plugins import load_general_plugins

    from kvguard.adapters.vllm import config, plugin

    from .conftest import undo_plugin_patches_with

    mp = pytest.MonkeyPatch()
    try:
        undo_plugin_patches_with(mp)
        mp.setattr(plugin, "_active", False)
        mp.setattr(config, "_by_config", False)
        for key in UNSET:
            mp.delenv(key, raising=False)
        # vLLM loads its plugins once per process, at its first engine build: loaded
        # now, that load cannot put back what a test takes out below.
        load_general_plugins()
        plugin.register()  # the start-up hooks (vLLM loaded the plugin before, too)
        yield mp
    finally:
        mp.undo()


def _in_process_engine(model_dir: str, **kwargs: Any) -> Any:
    from vllm import LLM

    with in_process():
        return LLM(model=model_dir, **ENGINE_KWARGS, **kwargs)


def _chunk_2_fault() -> list[int]:
    """A 158-token prompt whose second prefill chunk (positions 64..127) computes NaN."""
    return with_token(tokens(301, 158), 90, trigger(0))


# ---------------------------------------------------------------- in-process


def test_additional_config_alone_switches_the_guard_on_in_process(
    model_dir: str, reference: Any
) -> None:
    import vllm.envs

    a = _chunk_2_fault()
    (ref,) = generate(reference, [a])
    with plugin_patches_undone():
        stock = _in_process_engine(model_dir)
        try:
            assert type(scheduler(stock)).__name__ == "Scheduler"
            (out,) = generate(stock, [a])
            assert (90, trigger(0)) in faults_fired(stock)
            assert out.finish_reason == "length" and out.token_ids != ref.token_ids
        finally:
            shutdown(stock)

        with kvguard_log() as records:
            guarded = _in_process_engine(model_dir, additional_config=GUARD_CONFIG)
        try:
            (start,) = [r.getMessage() for r in records]
            assert "guard in force" in start and "workers checked: 1 OK;" in start, start
            sched = scheduler(guarded)
            assert type(sched).__name__ == "GuardedScheduler"
            assert sched.kvguard_pool.core is not None
            # Set by the plugin (absent from the environment here): what the engine
            # reads, frozen at its start (the build's environment is put back since).
            assert vllm.envs.VLLM_COMPUTE_NANS_IN_LOGITS
            assert sched.kv_cache_config.needs_kv_cache_zeroing
            (out,) = generate(guarded, [a])
            assert (90, trigger(0)) in faults_fired(guarded)
            assert out == Result((), "error", out.num_cached_tokens)
        finally:
            shutdown(guarded)


def test_a_worker_the_plugin_did_not_reach_refuses_the_start(model_dir: str) -> None:
    """The engine core asks every worker whether the guard is in force there; a worker
    where kvguard's plugin did not run (here: its hooks taken out of the worker class)
    cannot say, and the engine does not start. Stock vLLM would start, unguarded."""
    from vllm.v1.worker.worker_base import WorkerBase, WorkerWrapperBase

    from kvguard.adapters.vllm import plugin

    with plugin_patches_undone() as mp:
        mp.setattr(WorkerBase, "__init__", WorkerBase.__init__.__wrapped__)
        mp.delattr(WorkerWrapperBase, plugin.REPORT)
        with pytest.raises(Exception, match="kvguard was asked for") as raised:
            _in_process_engine(model_dir, additional_config=GUARD_CONFIG)
    message = str(raised.value)
    assert "--additional-config" in message and "worker" in message, message


def test_nan_counting_switched_off_refuses_the_start(model_dir: str) -> None:
    with plugin_patches_undone() as mp:
        mp.setenv("VLLM_COMPUTE_NANS_IN_LOGITS", "0")
        with pytest.raises(Exception, match="VLLM_COMPUTE_NANS_IN_LOGITS='0'"):
            _in_process_engine(model_dir, additional_config=GUARD_CONFIG)


# ---------------------------------------------------------------- multiprocess


@pytest.mark.parametrize("executor", ["uni", "mp"], ids=["worker-in-engine-core", "worker-process"])
def test_additional_config_alone_switches_the_guard_on_in_the_multiprocess_engine(
    model_dir: str, reference: Any, executor: str
) -> None:
    """The engine core runs in a process of its own, which inherits no kvguard setting,
    its worker in it (``uni``) or in another process again (``mp``: vLLM's
    multiprocess executor, whose worker the engine core asks over its message queue):
    the config they are sent is enough. A fails in chunk 2 and ends with "error"; R
    then reuses A's quarantined blocks, which the worker zeroed first."""
    from vllm import LLM

    a = _chunk_2_fault()
    r = tokens(302, 120)
    (ref_r,) = generate(reference, [r], max_tokens=4)
    env = dict(ENV, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    saved = apply_env(env)
    removed = {key: os.environ.pop(key) for key in UNSET if key in os.environ}
    try:
        llm = LLM(
            model=model_dir,
            **ENGINE_KWARGS,
            additional_config=GUARD_CONFIG,
            distributed_executor_backend=executor,
        )
    finally:
        os.environ.update(removed)
        restore_env(saved)
    try:
        assert type(llm.llm_engine.engine_core).__name__ == "SyncMPClient"
        (a_out,) = generate(llm, [a])
        assert (a_out.token_ids, a_out.finish_reason) == ((), "error")
        (r_out,) = generate(llm, [r], max_tokens=4)
        assert r_out.token_ids == ref_r.token_ids
        assert not non_finite_blocks(llm)
    finally:
        shutdown(llm)


# ---------------------------------------------------------------- vllm serve


@pytest.mark.parametrize("switch", ["additional-config", "environment"])
def test_vllm_serve_serves_kvguards_counters(
    model_dir: str, reference: Any, tmp_path: Any, switch: str
) -> None:
    """``vllm serve ... --additional-config '{"kvguard": {}}'`` (or ``KVGUARD_GUARD=1``
    in the server's environment): A fails in chunk 2 (500 to the client), R reuses A's
    two quarantined blocks. The API server's /metrics then shows kvguard's counters as
    the engine core counted them: one request aborted, two blocks quarantined, two
    zeroed, and at least A's four full blocks whose schedule-time publication was
    withheld."""
    a = _chunk_2_fault()
    r = tokens(303, 120)
    (ref_r,) = generate(reference, [r], max_tokens=4)
    env = {**os.environ, **ENV}
    for key in (*UNSET, "VLLM_ENABLE_V1_MULTIPROCESSING"):
        env.pop(key, None)
    extra: list[str] = []
    if switch == "environment":
        env["KVGUARD_GUARD"] = "1"
    else:
        extra = ["--additional-config", json.dumps(GUARD_CONFIG)]
    log = str(tmp_path / "serve.log")
    with serving(lambda: start(f"guarded by {switch}", model_dir, log, env, extra=extra)) as (
        server,
    ):
        before = server.metrics()
        assert not before.get('kvguard:requests_aborted_total{engine="0"}')
        status, body = server.complete(a)
        assert status == 500, body
        status, body = server.complete(r, max_tokens=4)
        assert status == 200 and body["choices"][0]["token_ids"] == list(ref_r.token_ids)
        after = server.metrics()
    sample = 'kvguard:{}_total{{engine="0"}}'.format
    assert after[sample("requests_aborted")] == 1, after
    assert after[sample("blocks_quarantined")] == 2, after
    assert after[sample("blocks_zeroed")] == 2, after
    assert after[sample("deferred_publications")] >= 4, after


# ---------------------------------------------------------------- pooling models


def test_a_pooling_model_runs_unguarded_with_one_log_line(model_dir: str) -> None:
    """The tiny Llama as an embedding model (vLLM's pooling runner), the guard asked
    for: the engine starts, embeds, and says once that it runs the model unguarded.
    (Before, the guarded scheduler refused the first output: no NaN counts.) Driven
    through vLLM's ``LLMEngine`` (``LLM.embed`` needs a tokenizer the model lacks)."""
    from vllm import PoolingParams, TokensPrompt
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    with plugin_patches_undone():
        engine_args = EngineArgs(
            model=model_dir,
            runner="pooling",
            convert="embed",
            additional_config=GUARD_CONFIG,
            **ENGINE_KWARGS,
        )
        with in_process(), kvguard_log() as records:
            llm_engine = LLMEngine.from_engine_args(engine_args)
        try:
            sched = llm_engine.engine_core.engine_core.scheduler
            # Pass-through: the guarded scheduler class built vLLM's own scheduler.
            assert type(sched).__name__ == "Scheduler"
            assert not hasattr(sched, "kvguard_pool")
            for i in range(3):
                llm_engine.add_request(
                    f"e{i}",
                    TokensPrompt(prompt_token_ids=tokens(310 + i, 40)),
                    PoolingParams(task="embed"),
                )
            done = {}
            for _ in range(20):
                for out in llm_engine.step():
                    if out.finished:
                        done[out.request_id] = out
                if len(done) == 3:
                    break
            assert sorted(done) == ["e0", "e1", "e2"]
            assert all(len(o.outputs.data) == 128 for o in done.values())
        finally:
            with contextlib.suppress(Exception):
                llm_engine.engine_core.shutdown()
    lines = [r.getMessage() for r in records if "is a pooling model" in r.getMessage()]
    assert len(lines) == 1 and "pass-through" in lines[0], lines
    assert not [r for r in records if "guard in force" in r.getMessage()]
