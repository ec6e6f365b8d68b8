"""The guarded scheduler's start-up and refusals: the factory that builds vLLM's own
scheduler with the guard off, the checks that refuse an engine the guard cannot cover
(no NaN counts, per-row counts under speculative decoding, the KV audit on a split
layout, a connector still bound to vLLM's pool), the guard's state, and the one INFO
line saying the guard is in force.

:class:`_GuardStartUp` is the base of every concern of the guarded scheduler (composed
in :mod:`.guarded`): it sets up the state they share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from kvguard.adapters.vllm._compat import require_supported_vllm, series_of
from kvguard.results import SlotRange
from kvguard.zeroing import ZeroPolicy

require_supported_vllm()

import vllm  # noqa: E402
import vllm.envs as envs  # noqa: E402
from vllm.logger import init_logger  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager  # noqa: E402

from kvguard.adapters.vllm.config import (  # noqa: E402
    GUARD_ENV,
    NAN_SETTING,
    GuardConfig,
    GuardConfigError,
    guard_config,
    is_pooling_model,
    stock_needs_zeroing,
    worker_counts_per_request,
    workers_checked,
    workers_zeroing,
)
from kvguard.adapters.vllm.exits.binding import rebind_connectors, stale_references  # noqa: E402
from kvguard.adapters.vllm.exits.coverage import gate_of, refuse_ungated  # noqa: E402
from kvguard.adapters.vllm.exits.gate import refuse_seals_for_groups  # noqa: E402
from kvguard.adapters.vllm.exits.handoff import reads_handoffs  # noqa: E402
from kvguard.adapters.vllm.metrics import (  # noqa: E402
    GuardMetrics,
    StatsSender,
    register_prometheus,
)
from kvguard.adapters.vllm.pool.block_pool import GuardModeUnsupported  # noqa: E402
from kvguard.adapters.vllm.pool.manager import install_guarded_pool  # noqa: E402
from kvguard.adapters.vllm.scheduler.step_ledger import StepLedger  # noqa: E402

logger = init_logger("vllm.kvguard.adapters.vllm.scheduler.guarded")
"""The guarded scheduler's one logger, whichever of its files logs (named as before its
concerns had files of their own, so that log filters keep working). Under vLLM's
logger: its handler, format (process name, pid) and level (``VLLM_LOGGING_LEVEL``)
apply, so the INFO start-up line shows in ``vllm serve``'s log. (A logger outside
``vllm`` reaches no handler of vLLM's: Python's last resort prints WARNING and above
only, bare.)"""


def _vllm_config_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``VllmConfig`` vLLM builds a scheduler with (its first argument)."""
    return kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]


def guard_for(vllm_config: Any) -> GuardConfig:
    """The guard's settings for this engine (:meth:`GuardConfig.from_vllm`), off for a
    pooling model -- its steps sample nothing and vLLM counts no NaNs for them, so no
    step could validate -- with a warning saying so."""
    guard = guard_config(vllm_config)
    if guard.enabled and is_pooling_model(vllm_config):
        logger.warning(
            "kvguard: %s is a pooling model (runner %r): its outputs carry no NaN "
            "counts, so the guard runs it in pass-through mode (vLLM's own KV cache "
            "behaviour, unguarded)",
            vllm_config.model_config.model,
            vllm_config.model_config.runner_type,
        )
        guard = dataclasses.replace(guard, enabled=False)
    return guard


def refuse_seals(vllm_config: Any, async_scheduling: bool) -> None:
    """Seals only where a worker reads the step's counts back on the host (synchronous
    scheduling) and holds all of the KV (one worker per engine): the seals ride on
    those counts, and each worker could fingerprint only the KV it holds."""
    if async_scheduling:
        raise GuardModeUnsupported(
            'kvguard\'s seals ("seal": true) need synchronous scheduling: under '
            "asynchronous scheduling the workers keep each step's NaN counts on the "
            "device, and the seals that ride on them would cost a host synchronisation "
            "every step. Drop --async-scheduling, or switch seals off."
        )
    refuse_audit_for_layout(vllm_config.parallel_config, 'seals ("seal": true)')


def refuse_audit_for_layout(
    parallel_config: Any, feature: str = 'KV audit ("audit": true)'
) -> None:
    """The KV audit (or seals) only where one worker holds all of the KV: each worker
    audits the KV it holds (its heads under tensor parallelism, its layers under
    pipeline or its tokens under context parallelism), but vLLM's executor returns one
    worker's per-request counts (the first of the last pipeline stage) and drops the
    others'."""
    sizes = {
        name: int(getattr(parallel_config, name, 1) or 1)
        for name in (
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "prefill_context_parallel_size",
            "decode_context_parallel_size",
        )
    }
    if all(size == 1 for size in sizes.values()):
        return
    layout = ", ".join(f"{name}={size}" for name, size in sizes.items() if size > 1)
    raise GuardModeUnsupported(
        f"kvguard's {feature} cannot cover this engine's parallel layout "
        f"({layout}): each worker reads only the KV it holds, and vLLM returns the "
        "per-request counts of one worker alone (the first of the last pipeline stage), "
        "so another worker's share would go unchecked. Switch it off (NaN logits are "
        "checked, and quarantined blocks zeroed, on every rank without it), or run one "
        "worker per engine (data parallelism keeps it)."
    )


def keep_zeroing_to_kvguard(scheduler: Any) -> None:
    """vLLM lists new blocks for zeroing only when it needs that itself: the plugin
    made ``needs_kv_cache_zeroing`` true so that workers build their zeroer, and vLLM
    would then zero every new block. Keep that to kvguard's zero queue (quarantined
    blocks under "suspect"; nothing in pass-through)."""
    if not stock_needs_zeroing(scheduler.kv_cache_config):
        for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
            manager._record_new_block_ids = False
            manager.new_block_ids.clear()


class _GuardStartUp:
    """The guard's start-up, and the state its concerns share; mixed in front of vLLM's
    scheduler classes (through each concern, :mod:`.guarded`)."""

    # Attributes of vLLM's Scheduler the guard reads (typed loosely: vLLM is untyped).
    kv_cache_manager: Any
    kv_cache_config: Any
    requests: dict[str, Any]
    vllm_config: Any
    connector: Any

    _vllm_scheduler: ClassVar[Any]
    """The vLLM class the guard is mixed into: what runs with the guard off."""

    if TYPE_CHECKING:
        # What one concern asks of another (each defined in its own file).
        def _kvguard_fill_settled(self, request_id: str, num_tokens: int) -> bool: ...
        def _kvguard_take_cached(self, scheduled: Mapping[str, int] | None = None) -> None: ...
        def _kvguard_reported_tokens(self, request_id: str) -> int: ...
        def _kvguard_finish_failing(self, failing: dict[str, int]) -> list[Any]: ...
        def _kvguard_name_window_frees(self) -> None: ...
        def _kvguard_window_frees(self, block_ids: list[int]) -> bool | None: ...
        def _kvguard_report_poisoned_loads(self, model_runner_output: Any) -> None: ...
        def finish_requests(self, request_ids: Any, finished_status: Any) -> Any: ...

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # The factory: the guard on, this class; off, vLLM's own scheduler, built with
        # the same arguments (not an instance of this class, so Python does not call
        # __init__ below on it).
        vllm_config = _vllm_config_of(args, kwargs)
        if guard_for(vllm_config).enabled:
            return super().__new__(cls)
        scheduler = cls._vllm_scheduler(*args, **kwargs)
        keep_zeroing_to_kvguard(scheduler)
        if not is_pooling_model(vllm_config):  # (guard_for said so for a pooling model)
            logger.info(
                'kvguard: guard switched off (%s=0 or "enabled": false): %s runs '
                "vLLM's own scheduler and KV cache, unguarded",
                GUARD_ENV,
                cls.__name__,
            )
        return scheduler

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        vllm_config = _vllm_config_of(args, kwargs)
        # Before vLLM builds the connectors: a refused one may not even import.
        refuse_ungated(vllm_config.kv_transfer_config)
        super().__init__(*args, **kwargs)
        guard = guard_for(self.vllm_config)  # on: __new__ built vLLM's scheduler otherwise
        if not envs.VLLM_COMPUTE_NANS_IN_LOGITS:
            raise GuardConfigError(
                f"kvguard validates each step by its per-request NaN logit counts, which "
                f"vLLM computes only with {NAN_SETTING}=1 in the environment of the engine "
                f"and its workers. Set {NAN_SETTING}=1, or KVGUARD_GUARD=0 to run the "
                "scheduler in pass-through mode."
            )
        if self.vllm_config.speculative_config is not None and not worker_counts_per_request():
            # vLLM 0.33's workers count NaNs per logits row and map row i to the i-th
            # request (nans_to_dict). With draft tokens a request has several rows, so
            # the counts name the wrong requests and rows past the batch size are
            # dropped: a step could validate KV computed from NaN logits. kvguard's
            # plugin makes the workers count per request (kvguard.adapters.vllm.workers.nans).
            raise GuardModeUnsupported(
                "kvguard validates steps under speculative decoding only when vLLM's "
                "workers count NaN logits per request, not per logits row (what vLLM "
                f"{vllm.__version__} does: with draft tokens its counts belong to other "
                f"requests). Set {GUARD_ENV}=1 in the environment of the engine and its "
                "workers, and keep kvguard among the plugins vLLM loads (VLLM_PLUGINS, if "
                "set): kvguard's vLLM plugin then makes every worker count per request. "
                "Or turn speculative decoding off, or run the scheduler in pass-through "
                f"mode ({GUARD_ENV}=0)."
            )
        if guard.audit:
            refuse_audit_for_layout(self.vllm_config.parallel_config)
        if guard.seal:
            refuse_seals(self.vllm_config, isinstance(self, AsyncScheduler))
            if reads_handoffs(self.vllm_config.kv_transfer_config):
                refuse_seals_for_groups(self.kv_cache_config)
        # Requests being finished because their step failed (never settled clean).
        self._kvguard_failing: dict[str, int] = {}
        # Requests that left after a clean step, whose blocks are not released yet.
        self._kvguard_clean: set[str] = set()
        # Requests whose latest step came back without a NaN count: not known clean
        # until a later step of theirs is counted clean.
        self._kvguard_unchecked: set[str] = set()
        # The request whose window, local chunk or R-SWA gap vLLM is freeing now.
        self._kvguard_window: str | None = None
        # Token slots recover() rolled back, for the workers to wipe before the next
        # step (SchedulerOutput.kvguard_slots_to_zero).
        self._kvguard_slots: list[SlotRange] = []
        # KV a connector is loading (or loaded, no step vouched for it yet) whose hash
        # was invalidated meanwhile: reported to vLLM as a failed load with the next
        # output (request ids of loads in flight; block ids of loaded KV).
        self._kvguard_poisoned_loads: tuple[set[str], set[int]] = (set(), set())
        # vLLM's fault handler is running (kvguard_fault): its abort recovers instead.
        self._kvguard_on_fault = False
        # The KV audit: the workers scan the blocks each step fills.
        self._kvguard_audit = guard.audit
        # Seals: the workers fingerprint the blocks each step fills.
        self._kvguard_seal = guard.seal
        # Reads of KV a prefill instance handed over, verified by their seals: request
        # id -> its local blocks (until the read is reported done).
        self._kvguard_handoffs: dict[str, set[int]] = {}
        # The blocks vLLM cached, per step in flight (and what else waits): the
        # scheduler's alone, fed from the pool's outbox (_kvguard_take_cached).
        self._kvguard_ledger = StepLedger(settles=self._kvguard_fill_settled)
        managers = self.kv_cache_manager.coordinator.single_type_managers
        windowed = any(type(m) is not FullAttentionManager for m in managers)
        vllm_pool = self.kv_cache_manager.block_pool
        self.kvguard_pool = install_guarded_pool(
            self.kv_cache_manager,
            guard,
            window_frees=self._kvguard_window_frees if windowed else None,
        )
        self._kvguard_rebind_connectors(vllm_pool)
        self._kvguard_setup_zeroing(self.kv_cache_config)
        # Connectors whose copies wait for a step's validation (GuardedExampleConnector).
        self._kvguard_settle_stores = [
            c.kvguard_settle_stores
            for c in self._kvguard_connectors()
            if hasattr(c, "kvguard_settle_stores")
        ]
        if windowed:
            self._kvguard_name_window_frees()
        self.kvguard_metrics = GuardMetrics()
        self.kvguard_metrics_label = register_prometheus(self)
        self._kvguard_stats_sender = StatsSender()
        self._kvguard_log_start()

    def _kvguard_log_start(self) -> None:
        """The one INFO line per engine saying the guard is in force, and how."""
        checked = workers_checked(self.vllm_config)
        gated = [gate_of(c) for c in self._kvguard_connectors() if not hasattr(c, "sub_connectors")]
        managers = self.kv_cache_manager.coordinator.single_type_managers
        groups = [type(m.kv_cache_spec).__name__ for m in managers]
        logger.info(
            "kvguard: guard in force (vLLM %s, series %s, %s): workers checked: %s; "
            "zero policy: %s (block zeroing: %s); KV audit: %s; seals: %s; prefix caching: %s; "
            "connectors gated: %s; KV cache groups guarded: %d (%s)",
            vllm.__version__,
            series_of(vllm.__version__),
            type(self).__name__,
            "not checked (scheduler built without kvguard's plugin)"
            if checked is None
            else f"{checked} OK",
            self.kvguard_pool.guard.zero_policy.value,
            workers_zeroing(self.vllm_config) or "not checked",
            "on" if self._kvguard_audit else "off",
            "on" if self._kvguard_seal else "off",
            "on" if self.kv_cache_manager.enable_caching else "off",
            ", ".join(gated) or "none",
            len(groups),
            ", ".join(groups),
        )

    def _kvguard_setup_zeroing(self, kv_cache_config: Any) -> None:
        """Only kvguard's zero queue goes to the worker, unless vLLM needs its own."""
        keep_zeroing_to_kvguard(self)
        if not kv_cache_config.needs_kv_cache_zeroing and (
            self.kvguard_pool.guard.zero_policy is not ZeroPolicy.NONE
        ):
            logger.warning(
                "kvguard: KVCacheConfig.needs_kv_cache_zeroing is false, so vLLM's workers "
                "do not build their block zeroer and quarantined blocks are reused "
                "unwiped. Start vLLM with KVGUARD_GUARD=1 (kvguard's vLLM plugin) to "
                "turn worker-side zeroing on."
            )

    def _kvguard_rebind_connectors(self, vllm_pool: Any) -> None:
        """vLLM bound the KV connectors to its own pool before kvguard's replaced it:
        bind them again, and refuse to start if one still holds vLLM's pool."""
        rebind_connectors(self)
        stale = stale_references(self, vllm_pool)
        if stale:
            holders = sorted({type(self._kvguard_holder(path)).__name__ for path in stale})
            raise GuardModeUnsupported(
                f"kvguard replaced vLLM's KV block pool, but the KV connector "
                f"{', '.join(holders)} still holds vLLM's discarded pool after being bound "
                f"again ({', '.join(stale)}): it would read and pin blocks no request "
                "holds. Run this connector on stock vLLM (no kvguard scheduler: neither "
                f"--additional-config '{{\"kvguard\": ...}}' nor {GUARD_ENV}=1 nor "
                "--scheduler-cls naming kvguard's), or run kvguard without it."
            )

    def _kvguard_holder(self, path: str) -> Any:
        """The connector object a stale reference's path starts from (the deepest
        object along it with ``bind_gpu_block_pool``, else the root)."""
        obj: Any = self
        holder: Any = None
        for part in path.replace("[", ".[").split("."):
            if not part:
                continue
            if part.startswith("["):
                key = part[1:-1]
                obj = obj[int(key)] if key.isdigit() else obj[key.strip("'")]
            else:
                obj = getattr(obj, part)
            if hasattr(obj, "bind_gpu_block_pool") or holder is None:
                holder = obj
        return holder

    def _kvguard_connectors(self) -> list[Any]:
        """The scheduler's KV connector, or the connectors inside a ``MultiConnector``."""
        connector = getattr(self, "connector", None)
        if connector is None:
            return []
        return [connector, *getattr(connector, "sub_connectors", ())]
