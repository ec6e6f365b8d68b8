"""vLLM 0.34's own scheduler tests, run a second time under kvguard's guard.

The modules here collect the vendored scheduler tests of ``tests/vllm/upstream/v0_34/``
(``test_scheduler.py``, ``test_async_scheduler.py``, ``test_deferred_block_free.py``,
``test_swa_inflight_window_free.py``, ``test_worker_slot_overflow.py``) again, each
test unmodified, "given clean outputs" (:mod:`.guard`):

- the scheduler a vendored helper or test builds (``utils.create_scheduler``,
  ``kv_connector_unit_utils.create_scheduler``, a test's own ``Scheduler(...)``) is
  kvguard's ``GuardedScheduler`` / ``GuardedAsyncScheduler`` with the guard on
  (``KVGUARD_GUARD=1``, workers counting NaNs per request as kvguard's plugin makes
  them, and ``KVGUARD_CHECK_INVARIANTS=1``: kvguard's pool is checked after every
  change);
- every ``ModelRunnerOutput`` a test hands to ``update_from_output`` carries a NaN
  count of 0 for each request it reports.

A test that passes on stock vLLM and fails here shows where the guard changes what
vLLM's scheduler does with clean steps; each is an expected failure (strict, with the
exception and the message it fails with: tests/vllm/upstream/expected_failure.py)
listed in :data:`LATER_PUBLICATION` (the guard publishes a block one step later than
vLLM, by design), :data:`INTERNALS` (the test reaches past the scheduler's interface,
into what the guard replaces) or :data:`REFUSED_CONFIGURATIONS` (the guard refuses the
test's configuration at start-up). The stock run's skips (``SKIPPED`` in
tests/vllm/upstream/conftest.py) apply here too.

Not guarded here: a pooling model (``runner="pooling"``: the guard runs it as vLLM's own
scheduler, as in the engine) and vLLM's ``DiffusionScheduler`` subclasses, which the
tests build by name (the guard is not mixed into them).

Run: ``HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu python -m pytest tests/vllm/upstream_guarded``
(vLLM 0.34 only; on another series each module here is skipped, as the vendored ones
are).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from kvguard.adapters.vllm import plugin
from kvguard.adapters.vllm.config import GuardConfigError
from kvguard.adapters.vllm.exits.coverage import COVERAGE, Coverage, Exit
from kvguard.adapters.vllm.pool.block_pool import GuardModeUnsupported
from tests.vllm.upstream import conftest as upstream
from tests.vllm.upstream.expected_failure import ExpectedFailure
from tests.vllm.upstream.v0_34 import conftest as vendored

from .guard import guard_vendored_modules

# What the vendored tests get from the conftest files beside them: vLLM's markers (for
# a run of this folder alone) and the stand-in for the Hugging Face hub.
pytest_configure = upstream.pytest_configure
hub_cache = vendored.hub_cache
offline_opt_125m = vendored.offline_opt_125m

_HERE = "tests/vllm/upstream_guarded/"

_LATER = (
    "kvguard publishes a block once the step that filled it has validated (its output "
    "came back clean); vLLM caches it while scheduling that step. "
)
_ABORTED_UNREPORTED = (
    _LATER + "Here a request is scheduled and then aborted before its step's output came "
    "back: vLLM has cached its prompt blocks; under the guard they were never validated, "
    "so they are quarantined, not cached, and {}"
)
_SEEDED_OUTSIDE_STEPS = (
    _LATER + "The test seeds its FA + Mamba prefix through KVCacheManager.allocate_slots "
    "and free, outside any scheduler step: no step validates those blocks, so the guard "
    "quarantines them as they are freed and the replay finds no hit. (Seeded by clean "
    "scheduler steps instead, the per-group hits diverge as the test expects, and a "
    "replay without external hit is scheduled from the same boundary as on stock vLLM.)"
)

_NO_HIT = r"^assert 80 == \(80 - \d+\)"
"""vLLM's assertion: the second request schedules its whole 80-token prompt (no hit),
not 80 minus its capped hit."""

_DIVERGED = r"^assert \(0, 0\) == \(32, 64\)"
_FA_DEEPER = r"^assert \(0, 0\) == \(64, 16\)"
_SEEDED_HITS = {
    # test[params] -> vLLM's assertion: no hit where the seeded prefix gave one
    "test_hybrid_per_group_hit_divergence_with_connector[0-16]": _DIVERGED,
    "test_hybrid_per_group_hit_divergence_with_connector[16-32]": _DIVERGED,
    # ([capped] expects no hit at all, and passes.)
    "test_hybrid_divergent_hit_fallback_is_capped_at_retained_auxiliary_outputs[kept]": (
        r"^assert 16 == 80\b"
    ),
    "test_hybrid_fa_deeper_hit_respects_connector_lookup_policy[True-0-5-16]": _FA_DEEPER,
    "test_hybrid_fa_deeper_hit_respects_connector_lookup_policy[True-16-6-80]": _FA_DEEPER,
    "test_hybrid_fa_deeper_hit_respects_connector_lookup_policy[False-16-6-32]": _FA_DEEPER,
}

LATER_PUBLICATION: dict[str, ExpectedFailure] = {
    # module::test, or module::test[params] for some parametrizations only
    # -> (what it fails with, its message, why)
    "test_async_scheduler.py::test_prefix_caching_for_prefill_dedup": ExpectedFailure(
        AssertionError,
        # (the second request schedules all 100 tokens, not its partial block only)
        r"^assert 100 == \(100 % 16\)",
        _LATER + "The test expects the second of two requests with one prompt, scheduled "
        "in the same step, to hit the first one's blocks (same-step de-duplication); under "
        "the guard it computes its prompt itself. The requests it adds after outputs came "
        "back hit all but the partial block, as on stock vLLM.",
    ),
    "test_scheduler.py::test_scheduler_publishes_lookahead_blocks_at_allocation": ExpectedFailure(
        AssertionError,
        r"^assert 0 == 2\b(?s:.*)num_cached_tokens",
        _LATER + "The test looks the prompt's first block up right after schedule(), "
        "before that step's output; under the guard it is matchable once the output came "
        "back clean (and the block ending at the first sampled token one step later).",
    ),
    "test_scheduler.py::test_kv_connector_honors_skip_reading_prefix_cache[True]": (
        ExpectedFailure(
            AssertionError,
            r"^assert 64 == 48\b",  # (the scoring request schedules all 64 tokens: no hit)
            _LATER + "KV a connector loads is published once a step of the request that loaded "
            "it vouches for it; the test expects the scoring request to hit, in the same step, "
            "the blocks the plain request has just loaded (its [False] case expects no hit).",
        )
    ),
    **{
        f"test_scheduler.py::test_prefix_hit_is_capped_at_retained_auxiliary_outputs[{p}]": (
            ExpectedFailure(
                AssertionError,
                _NO_HIT,
                _ABORTED_UNREPORTED.format(
                    "the second request has no local hit to cap (its [external*] cases, "
                    "without that first request, pass)"
                ),
            )
        )
        for p in ("local", "local-truncated", "local-sliding-window-truncated")
    },
    "test_scheduler.py::test_evicted_blocks_release_their_auxiliary_outputs_past_capacity": (
        ExpectedFailure(
            TypeError,
            "^'NoneType' object is not iterable$",  # list(metadata.retained_block_hashes)
            _ABORTED_UNREPORTED.format(
                "no cached block is retained or released: the step's aux-output connector "
                "metadata is None"
            ),
        )
    ),
    **{
        f"test_scheduler.py::{test}": ExpectedFailure(AssertionError, match, _SEEDED_OUTSIDE_STEPS)
        for test, match in _SEEDED_HITS.items()
    },
}

_BARE_SCHEDULER = ExpectedFailure(
    AttributeError,
    "^'CleanGuarded(Async)?Scheduler' object has no attribute 'kvguard_pool'$",
    "builds the scheduler with object.__new__ and Mocks, skipping __init__: the guard's "
    "state (its step ledger, kvguard's pool) is never set up, so the guarded "
    "update_from_output finds no kvguard_pool",
)

INTERNALS: dict[str, ExpectedFailure] = {
    # module::test -> (what it fails with, its message, why)
    "test_scheduler.py::test_abort_request_when_structured_output_fsm_cannot_advance": (
        _BARE_SCHEDULER
    ),
    "test_async_scheduler.py::test_abort_request_when_structured_output_fsm_cannot_advance": (
        _BARE_SCHEDULER
    ),
    "test_scheduler.py::test_memory_leak": ExpectedFailure(
        GuardModeUnsupported,
        r"^free_block_queue\.num_free_blocks: in guarded mode kvguard owns the free queue",
        "its leak check reads vLLM's BlockPool internals: free_block_queue, which kvguard's "
        "pool replaces (it owns the free queue; its stand-in answers only walks, "
        "iter_blocks_after, and refuses num_free_blocks), and "
        "ref_cnt == 0 on every block, the null block included, which kvguard holds "
        "(ref_cnt 1). The same check through get_num_free_blocks(), on every block but the "
        "null block, passes: nothing leaks",
    ),
    "test_scheduler.py::test_scheduler_kv_connector_stats": ExpectedFailure(
        TypeError,
        r"^Value after \* must be an iterable, not Mock$",  # (the Mock's sub_connectors)
        "swaps scheduler.connector for a Mock after the scheduler was built; the guard's "
        "stats (make_stats) look for a MultiConnector's sub_connectors and a guarded "
        "connector's kvguard_stats on it, which a Mock answers with Mocks. With a Mock "
        "that has neither, the test passes",
    ),
}


_STORAGE_WITHOUT_CACHING = ExpectedFailure(
    GuardConfigError,
    "^kvguard gates ExampleConnector's stores by the block hashes vLLM computes with prefix "
    "caching: turn prefix caching on",
    "The test runs vLLM's ExampleConnector with prefix caching off. kvguard gates that "
    "connector's stores by the block hashes vLLM computes with prefix caching (a store "
    "becomes visible once its blocks validated under their hashes), so the guarded "
    "scheduler refuses the configuration at start-up, naming the setting.",
)

REFUSED_CONFIGURATIONS: dict[str, ExpectedFailure] = {
    # module::test[params] -> (what it fails with, its message, why)
    f"{module}::{test}": _STORAGE_WITHOUT_CACHING
    for module, test in [
        ("test_async_scheduler.py", "test_requires_kv_delivery_defaults_to_producer_role"),
        ("test_async_scheduler.py", "test_kv_pressure_preempt_mid_handoff[kv_producer-False]"),
        ("test_async_scheduler.py", "test_kv_pressure_preempt_mid_handoff[kv_consumer-False]"),
        ("test_async_scheduler.py", "test_kv_pressure_preempt_mid_handoff[kv_consumer-True]"),
        (
            "test_scheduler.py",
            "test_priority_scheduling_preemption_and_resumption_when_out_of_kv[False-None]",
        ),
        (
            "test_scheduler.py",
            "test_priority_scheduling_preemption_and_resumption_when_out_of_kv[True-ec_consumer]",
        ),
        ("test_scheduler.py", "test_prepend_skipped_requests_order"),
        ("test_scheduler.py", "test_abort_request_waiting_for_remote_kvs"),
        ("test_scheduler.py", "test_abort_request_finished_recving"),
        ("test_scheduler.py", "test_delayed_kv_connector_free_keeps_scheduler_active"),
    ]
}
"""Configurations the guard refuses at start-up, by design (docs/vllm-reference.md)."""

EXPECTED_FAILURES = {**LATER_PUBLICATION, **INTERNALS, **REFUSED_CONFIGURATIONS}


@pytest.fixture(autouse=True)
def guarded(monkeypatch: pytest.MonkeyPatch, per_request_nans: None) -> Iterator[None]:
    """The vendored modules build kvguard's guarded schedulers (``per_request_nans``:
    with the guard on, and NaNs counted per request), checked after every change."""
    monkeypatch.setenv("KVGUARD_CHECK_INVARIANTS", "1")
    guard_vendored_modules(monkeypatch)
    # The KV connectors they name, as in an engine under kvguard's plugin: vLLM's
    # ExampleConnector is the gated one, and vLLM's test connector (``MockKVConnector``,
    # which plays a prefill/decode or load-only connector) is declared gated at
    # request_finished, as a user declares an out-of-tree connector ("kvguard_exit").
    factory = KVConnectorFactory
    monkeypatch.setattr(factory, "get_connector_class", factory.__dict__["get_connector_class"])
    monkeypatch.setattr(factory, "_registry", dict(factory._registry))
    plugin._patch_connector_cls()
    monkeypatch.setitem(COVERAGE, "MockKVConnector", Coverage(Exit.AT_FINISH))
    yield


def pytest_itemcollected(item: pytest.Item) -> None:
    # kvguard's `vllm` marker (CI selects ``-m vllm``), as for the vendored modules.
    if item.get_closest_marker("vllm") is None:
        item.add_marker(pytest.mark.vllm)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE not in item.path.as_posix():
            continue
        # "tests/vllm/upstream_guarded/test_x.py::test_f[p]" -> "test_x.py::test_f[p]"
        upstream.mark_guarded_item(item, item.nodeid.split(_HERE, 1)[-1], EXPECTED_FAILURES)
