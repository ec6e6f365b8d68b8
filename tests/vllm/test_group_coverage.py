"""Every KV cache group type vLLM has is either guarded or refused at start-up with a
message that names it, says why and what to do -- and the guarded ones that are never
published (cross-attention, circular buffer) quarantine what a failed request wrote
and free what a clean one wrote plainly.

The sliding-window, chunked-local and R-SWA groups are tested in
``test_windowed_groups.py``, full attention everywhere else.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

import vllm  # noqa: E402
from vllm.v1.core import single_type_kv_cache_manager as vllm_managers  # noqa: E402

from kvguard import BlockState  # noqa: E402
from kvguard.adapters.vllm._compat import series_of  # noqa: E402
from kvguard.adapters.vllm.pool.block_pool import GuardModeUnsupported  # noqa: E402
from kvguard.adapters.vllm.pool.manager import (  # noqa: E402
    GUARDED_MANAGERS,
    REFUSED_MANAGERS,
    group_refusal,
    refuse_unguarded_groups,
)
from kvguard.adapters.vllm.scheduler.guarded import GuardedScheduler  # noqa: E402

from . import harness  # noqa: E402
from .harness import (  # noqa: E402
    BLOCK,
    finish_reasons,
    make_request,
    make_scheduler,
    model_output,
    step,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "vllm-reference.md"
PROMPT = list(range(3000, 3000 + 3 * BLOCK + 3))


def vllm_manager_classes() -> list[type]:
    """Every single-type KV cache manager the installed vLLM defines (its private
    bases, which no group is built with, left out)."""
    found: list[type] = []
    todo: list[type] = [vllm_managers.SingleTypeKVCacheManager]
    while todo:
        subclasses: list[type] = todo.pop().__subclasses__()
        for sub in subclasses:
            if sub not in found:
                found.append(sub)
                todo.append(sub)
    return [
        cls
        for cls in found
        if cls.__module__.startswith("vllm.") and not cls.__name__.startswith("_")
    ]


def _count(s: Any, state: BlockState) -> int:
    return int(s.kvguard_pool.core.stats().blocks_by_state[state])


# ---------------------------------------------------------------- coverage


def test_every_vllm_group_type_is_guarded_or_refused_by_name() -> None:
    """A group type a new vLLM adds fails here until kvguard decides on it (at run time
    it is refused anyway, with a generic message)."""
    classes = vllm_manager_classes()
    assert vllm_managers.FullAttentionManager in classes
    undecided = [
        cls.__name__
        for cls in classes
        if cls not in GUARDED_MANAGERS and cls.__name__ not in REFUSED_MANAGERS
    ]
    assert not undecided, f"vLLM KV cache managers kvguard neither guards nor refuses: {undecided}"
    assert not any(cls.__name__ in REFUSED_MANAGERS for cls in GUARDED_MANAGERS)


@pytest.mark.parametrize("cls", vllm_manager_classes(), ids=lambda cls: cls.__name__)
def test_each_group_type_starts_guarded_or_is_refused_with_why_and_what_to_do(cls: type) -> None:
    manager: Any = object.__new__(cls)  # only its type is read
    if cls in GUARDED_MANAGERS:
        assert group_refusal(cls) is None
        refuse_unguarded_groups([manager])
        return
    with pytest.raises(GuardModeUnsupported) as raised:
        refuse_unguarded_groups([object.__new__(vllm_managers.FullAttentionManager), manager])
    message = str(raised.value)
    assert f"{cls.__name__} groups: {REFUSED_MANAGERS[cls.__name__]}" in message
    assert message.count(" groups: ") == 1  # the guarded group is not named
    assert "KVGUARD_GUARD=0" in message and '"enabled": false' in message


def test_a_group_type_kvguard_does_not_know_is_refused() -> None:
    class TomorrowsManager(vllm_managers.FullAttentionManager):
        pass

    with pytest.raises(GuardModeUnsupported, match="TomorrowsManager groups: a KV cache group"):
        refuse_unguarded_groups([object.__new__(TomorrowsManager)])


def test_the_docs_coverage_table_names_every_decision() -> None:
    text = DOCS.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    for cls in vllm_manager_classes():
        row = [line for line in rows if f"`{cls.__name__}`" in line]
        assert row, f"docs/vllm-reference.md's coverage table has no row for {cls.__name__}"
        decision = "guarded" if cls in GUARDED_MANAGERS else "refused"
        assert f"**{decision}**" in row[0], (cls.__name__, row[0])


# ---------------------------------------------------------------- sink


@pytest.mark.parametrize("guarded", [False, True])
def test_vllm_cannot_build_a_sink_group(guarded: bool) -> None:
    """Refused by kvguard, and unbuildable on vLLM 0.32-0.34 anyway: the sink manager's
    constructor rejects what the coordinator passes. When a vLLM release builds it,
    this fails: decide then whether to guard it (REFUSED_MANAGERS says what stands in
    the way)."""
    with pytest.raises(TypeError, match="SinkFullAttentionManager"):
        make_scheduler(guarded=guarded, groups=("full", "sink"))


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("groups", [("full", "ring")])
def test_clean_trace_same_decisions_as_stock_vllm(
    groups: tuple[str, ...], async_scheduling: bool
) -> None:
    arrivals = harness.shared_prefix_arrivals(5, 8, 4 * BLOCK, (5, 20))
    runs = []
    for guarded in (False, True):
        s = make_scheduler(
            guarded=guarded, groups=groups, async_scheduling=async_scheduling, num_blocks=48
        )
        runs.append(harness.decision_trace(s, arrivals, 60, async_scheduling=async_scheduling))
        if guarded:
            assert s.kvguard_stats()["blocks_quarantined"] == 0
            assert s.kvguard_stats()["blocks_zeroed"] == 0
            s.kvguard_pool.check_consistency()
    assert runs[0] == runs[1]
    assert any(h for entry in runs[0] if isinstance(entry, tuple) for h in entry[2].values())


# ---------------------------------------------------------------- circular buffer


def _ring(s: Any, req_id: str) -> int:
    (block_id,) = s.kv_cache_manager.get_block_ids(req_id)[-1]
    return int(block_id)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_ring_block_of_a_clean_request_is_freed_plainly(prefix_caching: bool) -> None:
    s = make_scheduler(groups=("full", "ring"), prefix_caching=prefix_caching)
    s.add_request(make_request("a", PROMPT, max_tokens=3))
    step(s)
    ring = _ring(s, "a")
    assert s.kvguard_pool.core.block_state(ring) is BlockState.WRITTEN  # rewritten each step
    outputs = [step(s)[1] for _ in range(2)]
    assert {"a": "length"} in [finish_reasons(out) for out in outputs]
    assert s.kvguard_pool.core.block_state(ring) is BlockState.FREE
    assert s.kvguard_stats()["blocks_quarantined"] == 0
    s.add_request(make_request("b", PROMPT[:5], max_tokens=2))
    so, _ = step(s)
    assert not so.new_block_ids_to_zero
    s.kvguard_pool.check_consistency()


def test_ring_block_of_a_failed_request_is_quarantined_and_zeroed_before_reuse() -> None:
    s = make_scheduler(groups=("full", "ring"))
    s.add_request(make_request("a", PROMPT, max_tokens=10))
    s.add_request(make_request("bystander", list(range(8000, 8020)), max_tokens=10))
    step(s)
    step(s)
    ring = _ring(s, "a")
    _, out = step(s, {"a": 1})
    assert finish_reasons(out) == {"a": "error"}
    assert "bystander" in s.requests
    assert s.kvguard_pool.core.block_state(ring) is BlockState.QUARANTINED
    s.add_request(make_request("b", list(range(9000, 9005)), max_tokens=2))
    so, _ = step(s)
    # Quarantined blocks (a's ring and its partial tail) are reused first, zeroed
    # before the step that writes them.
    assert ring in {b for group in s.kv_cache_manager.get_block_ids("b") for b in group}
    assert ring in (so.new_block_ids_to_zero or [])
    s.kvguard_pool.check_consistency()


def test_recover_ends_a_request_with_a_ring_block_rather_than_resume_it() -> None:
    s = make_scheduler(groups=("full", "ring"))
    s.add_request(make_request("a", PROMPT, max_tokens=10))
    step(s)
    s.schedule()  # a decode step whose output is lost
    report = s.recover()
    assert not report.resumed
    [(request, why)] = report.ended
    assert request.request_id == "a" and "circular buffer" in why
    s.kvguard_pool.check_consistency()


# ---------------------------------------------------------------- cross-attention

ENCODER_TOKENS = 2 * BLOCK + 5  # three cross-attention blocks
DECODER_PROMPT = [50258, 50259, 50359, 50363]  # a Whisper-style start of transcript


def _encoder_decoder(guarded: bool = True, **kwargs: Any) -> Any:
    return make_scheduler(
        guarded=guarded,
        groups=("full", "cross"),
        encoder_decoder=True,
        prefix_caching=False,
        max_num_batched_tokens=1024,
        **kwargs,
    )


def _transcribe(req_id: str, max_tokens: int = 4) -> Any:
    return make_request(req_id, DECODER_PROMPT, max_tokens, encoder_tokens=ENCODER_TOKENS)


def _cross(s: Any, req_id: str) -> list[int]:
    return list(s.kv_cache_manager.get_block_ids(req_id)[1])


def test_cross_attention_blocks_of_a_clean_request_are_freed_plainly() -> None:
    s = _encoder_decoder()
    s.add_request(_transcribe("a", max_tokens=3))
    so, _ = step(s)  # runs the encoder: writes the cross-attention KV
    assert so.scheduled_encoder_inputs == {"a": [0]}
    cross = _cross(s, "a")
    assert len(cross) == 3
    core = s.kvguard_pool.core
    assert all(core.block_state(b) is BlockState.WRITTEN for b in cross)
    outputs = [step(s)[1] for _ in range(2)]
    assert {"a": "length"} in [finish_reasons(out) for out in outputs]
    assert all(core.block_state(b) is BlockState.FREE for b in cross)
    assert s.kvguard_stats()["blocks_quarantined"] == 0
    s.add_request(_transcribe("b"))
    so, _ = step(s)
    assert not so.new_block_ids_to_zero
    s.kvguard_pool.check_consistency()


@pytest.mark.parametrize("failing_step", [0, 2], ids=["encoder-step", "decode-step"])
def test_cross_attention_blocks_of_a_failed_request_are_quarantined_and_zeroed(
    failing_step: int,
) -> None:
    """NaN in the step that ran the encoder, or in a later decode step: the request is
    aborted, its cross-attention blocks (never validated: no step publishes them) are
    quarantined with the rest, and zeroed before the next request writes them."""
    s = _encoder_decoder()
    s.add_request(_transcribe("a", max_tokens=10))
    s.add_request(_transcribe("bystander", max_tokens=10))
    for _ in range(failing_step):
        step(s)
    so = s.schedule()
    cross = _cross(s, "a")
    out = s.update_from_output(so, model_output(s, so, {"a": 7}))
    assert finish_reasons(out) == {"a": "error"}
    assert "bystander" in s.requests
    core = s.kvguard_pool.core
    assert all(core.block_state(b) is BlockState.QUARANTINED for b in cross)
    assert s.kvguard_stats()["blocks_quarantined"] == len(cross) + 1  # + its decoder block
    s.add_request(_transcribe("b"))
    so, _ = step(s)
    assert set(cross) <= {b for group in s.kv_cache_manager.get_block_ids("b") for b in group}
    assert set(cross) <= set(so.new_block_ids_to_zero or [])
    s.kvguard_pool.check_consistency()


def test_encoder_decoder_clean_run_same_decisions_as_stock_vllm() -> None:
    traces = []
    for guarded in (False, True):
        s = _encoder_decoder(guarded=guarded, num_blocks=24)
        trace: list[object] = []
        for t in range(30):
            if t % 3 == 0 and t < 24:
                s.add_request(_transcribe(f"r{t}", max_tokens=5 + t % 4))
            so, out = step(s)
            trace.append((dict(so.num_scheduled_tokens), sorted(so.preempted_req_ids)))
            trace.append(finish_reasons(out))
            trace.append({r: len(_cross(s, r)) for r in s.requests})
        traces.append(trace)
        if guarded:
            assert s.kvguard_stats()["blocks_quarantined"] == 0
            s.kvguard_pool.check_consistency()
    assert traces[0] == traces[1]


def test_recover_ends_a_request_with_cross_attention_blocks_rather_than_resume_it() -> None:
    s = _encoder_decoder()
    s.add_request(_transcribe("a", max_tokens=10))
    step(s)
    s.schedule()  # a decode step whose output is lost
    report = s.recover()
    [(request, why)] = report.ended
    assert request.request_id == "a" and "encoder's KV" in why
    assert not report.resumed


# vLLM 0.34's own cross-attention allocation tests (vendored in upstream/v0_34), run on
# the guarded scheduler.
VENDORED_CROSS_ATTENTION = (
    "test_variable_length_cross_attn_block_allocation",
    "test_cross_attn_blocks_not_over_allocated",
    "test_cross_attn_blocks_not_under_allocated",
    "test_cross_attn_zero_blocks_without_encoder_inputs",
)


@pytest.mark.skipif(
    series_of(vllm.__version__) != "0.34", reason="vendored from vLLM 0.34 (its API)"
)
@pytest.mark.parametrize("name", VENDORED_CROSS_ATTENTION)
def test_vllm_cross_attention_tests_pass_on_the_guarded_scheduler(
    name: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    # What tests/vllm/upstream's conftests do for the vendored modules (vLLM's markers,
    # the names they import from vLLM's test tree), when this file runs alone. (Imported
    # by name: mypy leaves the vendored module unchecked.)
    importlib.import_module("tests.vllm.upstream.conftest").pytest_configure(request.config)
    importlib.import_module("tests.vllm.upstream.v0_34.conftest").register_aliases()
    vendored = importlib.import_module("tests.vllm.upstream.v0_34.test_scheduler")

    model_config = vendored.ModelConfig

    def local_model_config(**kwargs: Any) -> Any:
        # facebook/opt-125m from the hub (offline here): the harness's local stand-in.
        kwargs["model"] = harness._MODEL_DIR
        kwargs.pop("trust_remote_code", None)
        return model_config(**kwargs, skip_tokenizer_init=True)

    guarded: list[Any] = []

    def guarded_scheduler(*args: Any, **kwargs: Any) -> Any:
        scheduler = GuardedScheduler(*args, **kwargs)
        guarded.append(scheduler)
        return scheduler

    monkeypatch.setenv("KVGUARD_GUARD", "1")
    monkeypatch.setattr(vendored, "ModelConfig", local_model_config)
    monkeypatch.setattr(vendored, "Scheduler", guarded_scheduler)
    getattr(vendored, name)()
    assert guarded and all(isinstance(s, GuardedScheduler) for s in guarded)
    for s in guarded:
        s.kvguard_pool.check_consistency()
