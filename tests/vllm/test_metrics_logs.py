"""What an operator reads in vLLM's log: one INFO line per engine saying the guard is
in force (and how), and one WARNING per request the guard aborts, naming it, the
positions its failing step computed and the NaN count. Both through vLLM's logger
(``vllm.kvguard...``), so that ``vllm serve`` prints them with its own lines."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from kvguard.adapters.vllm import config as settings  # noqa: E402
from kvguard.adapters.vllm import plugin  # noqa: E402
from kvguard.adapters.vllm.scheduler import guarded as scheduler_module  # noqa: E402
from kvguard.adapters.vllm.scheduler import startup as startup_module  # noqa: E402

from .harness import BLOCK, make_request, make_scheduler, make_vllm_config, step  # noqa: E402

START = "kvguard: guard in force"
ABORT = "kvguard: aborted request"


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``caplog`` gets what the guarded scheduler logs at INFO and above. (Its logger
    sits under vLLM's, which stops propagation once vLLM configured logging: the
    records are caught at the scheduler's logger.)"""
    logger = scheduler_module.logger
    assert logger.name == "vllm.kvguard.adapters.vllm.scheduler.guarded"
    monkeypatch.setattr(logger, "propagate", False)
    caplog.set_level(logging.INFO, logger=logger.name)  # (setLevel: clears the level cache)
    logger.addHandler(caplog.handler)
    disabled = logging.root.manager.disable  # (vLLM's suppress_logging can leave it set)
    logging.disable(logging.NOTSET)
    try:
        yield
    finally:
        logging.disable(disabled)
        logger.removeHandler(caplog.handler)


def _lines(caplog: pytest.LogCaptureFixture, prefix: str, level: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith(prefix) and r.levelno == level
    ]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_one_info_line_per_scheduler_says_the_guard_is_in_force(
    async_scheduling: bool, log: None, caplog: pytest.LogCaptureFixture
) -> None:
    import vllm

    s = make_scheduler(async_scheduling=async_scheduling, groups=("full", "sliding"))
    (line,) = _lines(caplog, START, logging.INFO)
    series = ".".join(vllm.__version__.split("+")[0].split(".")[:2])
    assert f"(vLLM {vllm.__version__}, series {series}, {type(s).__name__})" in line
    # Built by hand (no engine core asked its workers): said so, not assumed.
    assert "workers checked: not checked" in line
    assert "zero policy: suspect" in line
    assert "prefix caching: on" in line
    assert "connectors gated: none;" in line
    assert line.endswith("KV cache groups guarded: 2 (FullAttentionSpec, SlidingWindowSpec)")
    make_scheduler(async_scheduling=async_scheduling)
    assert len(_lines(caplog, START, logging.INFO)) == 2  # one per scheduler (engine)


def test_the_start_up_line_names_the_gated_connector_and_the_zero_policy(
    log: None, caplog: pytest.LogCaptureFixture
) -> None:
    from .test_offloading import offload_scheduler

    offload_scheduler(kvguard={"zero_policy": "all"})
    (line,) = _lines(caplog, START, logging.INFO)
    assert "connectors gated: GuardedOffloadingConnector;" in line
    assert "zero policy: all" in line


def test_the_start_up_line_counts_the_workers_the_engine_core_checked(
    log: None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``check_workers`` (the engine core, before it builds its scheduler) records how
    many workers reported the guard in force, for that engine's config only."""
    config = make_vllm_config()
    ok = {key: True for key in plugin._MISSING}
    monkeypatch.setattr(settings, "_checked", None)
    plugin.check_workers(lambda method: [ok, ok], config)
    assert settings.workers_checked(config) == 2
    assert settings.workers_checked(make_vllm_config()) is None  # another engine's config

    monkeypatch.setattr(startup_module, "workers_checked", lambda vllm_config: 2)
    make_scheduler()
    (line,) = _lines(caplog, START, logging.INFO)
    assert "workers checked: 2 OK;" in line


def test_pass_through_says_so_in_one_info_line(log: None, caplog: pytest.LogCaptureFixture) -> None:
    make_scheduler(kvguard={"enabled": False})
    assert not _lines(caplog, START, logging.INFO)
    (line,) = _lines(caplog, "kvguard: guard switched off", logging.INFO)
    assert "unguarded" in line


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_one_warning_per_aborted_request_names_it_the_positions_and_the_nan_count(
    async_scheduling: bool, log: None, caplog: pytest.LogCaptureFixture
) -> None:
    """a's second prefill chunk (positions BLOCK..2 BLOCK-1) has NaN logits; b, in
    the same steps, is clean: one WARNING, for a."""
    s = make_scheduler(max_num_batched_tokens=2 * BLOCK, async_scheduling=async_scheduling)
    s.add_request(make_request("a", list(range(7000, 7000 + 3 * BLOCK))))
    s.add_request(make_request("b", list(range(8000, 8000 + BLOCK // 2))))
    caplog.clear()
    if async_scheduling:
        # Two steps in flight, as under async scheduling; the second is a's chunk 2.
        first, second = s.schedule(), s.schedule()
        from .harness import model_output

        s.update_from_output(first, model_output(s, first))
        s.update_from_output(second, model_output(s, second, {"a": 7}))
    else:
        step(s)  # a: 0..BLOCK+BLOCK/2-1 alongside b's prompt
        step(s, {"a": 7})
    (line,) = _lines(caplog, ABORT, logging.WARNING)
    assert line.startswith(
        f"kvguard: aborted request a (finish reason 'error'): the step computing its "
        f"positions {2 * BLOCK}..{3 * BLOCK - 1} (prompt {3 * BLOCK} tokens, 0 output "
        "token(s)) had 7 NaN logit(s); its tokens are not delivered"
    ), line
    assert s.kvguard_stats()["requests_aborted"] == 1
    step(s)
    step(s)
    assert len(_lines(caplog, ABORT, logging.WARNING)) == 1  # clean steps log nothing


def test_a_decode_abort_names_its_position_with_the_next_step_in_flight(
    log: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Async scheduling: d's first decode step (position P, the prompt's length) comes
    back with NaN while its next decode step (P + 1) is already scheduled: the line
    names position P, not the one in flight."""
    from .harness import model_output

    s = make_scheduler(async_scheduling=True)
    prompt = list(range(9000, 9000 + BLOCK // 2))
    s.add_request(make_request("d", prompt, max_tokens=8))
    prefill, decode = s.schedule(), s.schedule()
    s.update_from_output(prefill, model_output(s, prefill))
    s.schedule()  # d's next decode, in flight
    s.update_from_output(decode, model_output(s, decode, {"d": 1000}))
    (line,) = _lines(caplog, ABORT, logging.WARNING)
    p = len(prompt)
    assert f"positions {p}..{p} (prompt {p} tokens, 1 output token(s)) had 1000 NaN" in line
