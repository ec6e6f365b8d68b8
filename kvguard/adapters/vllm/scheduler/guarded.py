"""Guarded schedulers: vLLM's ``Scheduler`` / ``AsyncScheduler`` on kvguard's pool.

Select with ``SchedulerConfig.scheduler_cls`` (``--scheduler-cls``)::

    kvguard.adapters.vllm.scheduler.GuardedScheduler
    kvguard.adapters.vllm.scheduler.GuardedAsyncScheduler

What changes against vLLM (everything else is vLLM's own code path):

* ``schedule``: blocks vLLM hands out are WRITTEN (kvguard) from then on; full blocks
  vLLM caches while scheduling the step are only *marked* for publication and noted
  as filled by this step (one record per step in the pool's
  :class:`~kvguard.adapters.vllm.scheduler.step_ledger.StepLedger`, no per-request work).
* ``update_from_output``: before vLLM processes the output, every request whose row
  in ``num_nans_in_logits`` is non-zero is finished with ``FINISHED_ERROR`` (its
  client sees finish reason ``"error"``, its NaN-derived tokens are never delivered)
  and the blocks its in-flight steps filled are QUARANTINED (its partial tail on
  release); the blocks the other requests' steps filled are validated in one call,
  and enter the prefix cache only then. A request ending with no step in flight after
  a clean step has its partial tail validated as its blocks are released
  (``free_blocks(..., steps_passed=True)``); one freed or preempted with a step in
  flight, or whose blocks a connector holds on to, is forgotten, and its unvalidated
  blocks are quarantined on release.
* with the KV audit on (``{"kvguard": {"audit": true}}``) each step carries the blocks
  it fills (``kvguard_blocks_to_audit``); the workers add the blocks holding NaN or an
  infinity to the request's NaN count (:mod:`kvguard.adapters.vllm.workers.audit`), so
  such a step fails as for NaN logits. Blocks cached while an output is processed are
  then carried to the request's next step, which audits them, instead of validated on
  the spot.
* ``new_block_ids_to_zero`` carries kvguard's zero queue (quarantined blocks being
  reused, or every new block under ``zero_policy=all``) instead of vLLM's "every new
  block" list. Workers apply it only when ``KVCacheConfig.needs_kv_cache_zeroing`` is
  true: the plugin (``KVGUARD_GUARD=1``, :mod:`kvguard.adapters.vllm.plugin`) makes it
  so; without it the scheduler logs a warning.

With the guard off (``KVGUARD_GUARD=0``, ``{"enabled": false}``, or a pooling model)
both classes build vLLM's own ``Scheduler`` / ``AsyncScheduler`` instead: pass-through
is vLLM's own code, not a mode of the guarded classes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

from kvguard.adapters.vllm._compat import require_supported_vllm, series_of
from kvguard.errors import EngineContractError, RollbackError
from kvguard.hashing import BlockHash
from kvguard.results import SlotRange
from kvguard.zeroing import ZeroPolicy

require_supported_vllm()

import vllm  # noqa: E402
import vllm.envs as envs  # noqa: E402
from vllm.logger import init_logger  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import hash_block_tokens  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvguard.adapters.vllm.config import GuardConfig, GuardConfigError  # noqa: E402
from kvguard.adapters.vllm.exits.binding import rebind_connectors, stale_references  # noqa: E402
from kvguard.adapters.vllm.exits.coverage import (  # noqa: E402
    NORMAL_ENDS,
    gate_of,
    refuse_ungated,
    withhold_from_connector,
)
from kvguard.adapters.vllm.exits.tier_purge import TierPurgeReport  # noqa: E402
from kvguard.adapters.vllm.metrics import (  # noqa: E402
    GuardMetrics,
    StatsSender,
    connector_counters,
    register_prometheus,
)
from kvguard.adapters.vllm.plugin import (  # noqa: E402
    GUARD_ENV,
    guard_config,
    stock_needs_zeroing,
    worker_counts_per_request,
    workers_checked,
    workers_zeroing,
)
from kvguard.adapters.vllm.pool.block_pool import GuardModeUnsupported, group_suffix  # noqa: E402
from kvguard.adapters.vllm.pool.manager import install_guarded_pool  # noqa: E402
from kvguard.adapters.vllm.scheduler.recovery import (  # noqa: E402
    RecoveryReport,
    ResumedRequest,
    requests_to_recover,
    roll_back_request,
    why_not_resumable,
)
from kvguard.adapters.vllm.scheduler.step_ledger import HeldFills, StepLedger, StepRecord  # noqa: E402

logger = init_logger(f"vllm.{__name__}")
"""Under vLLM's logger: its handler, format (process name, pid) and level
(``VLLM_LOGGING_LEVEL``) apply, so the INFO start-up line shows in ``vllm serve``'s log.
(A logger outside ``vllm`` reaches no handler of vLLM's: Python's last resort prints
WARNING and above only, bare.)"""

NAN_SETTING = "VLLM_COMPUTE_NANS_IN_LOGITS"
_NONE: frozenset[str] = frozenset()


def _vllm_config_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``VllmConfig`` vLLM builds a scheduler with (its first argument)."""
    return kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]


def is_pooling_model(vllm_config: Any) -> bool:
    """Whether the engine runs a pooling model (embedding, reranking, ...): its steps
    sample nothing and vLLM reports no NaN counts for them."""
    return bool(vllm_config.model_config.runner_type == "pooling")


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


def refuse_audit_for_layout(parallel_config: Any) -> None:
    """The KV audit only where one worker holds all of the KV: each worker audits the
    KV it holds (its heads under tensor parallelism, its layers under pipeline or its
    tokens under context parallelism), but vLLM's executor returns one worker's
    per-request counts (the first of the last pipeline stage) and drops the others'."""
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
        f"kvguard's KV audit (\"audit\": true) cannot cover this engine's parallel layout "
        f"({layout}): each worker audits only the KV it holds, and vLLM returns the "
        "per-request counts of one worker alone (the first of the last pipeline stage), "
        "so non-finite KV in another worker's share would be published unseen. Switch the "
        "audit off (NaN logits are checked, and quarantined blocks zeroed, on every rank "
        "without it), or run the audit with one worker per engine (data parallelism keeps "
        "it)."
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


class _GuardMixin:
    """The guard's hooks; mixed in front of vLLM's scheduler classes."""

    # Attributes of vLLM's Scheduler this mixin reads (typed loosely: vLLM is untyped).
    kv_cache_manager: Any
    kv_cache_config: Any
    requests: dict[str, Any]
    vllm_config: Any
    connector: Any

    _vllm_scheduler: ClassVar[Any]
    """The vLLM class the guard is mixed into: what runs with the guard off."""

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
        # Every publication held back, per step in flight (and what else waits).
        self._kvguard_ledger = StepLedger(settles=self._kvguard_fill_settled)
        managers = self.kv_cache_manager.coordinator.single_type_managers
        windowed = any(type(m) is not FullAttentionManager for m in managers)
        vllm_pool = self.kv_cache_manager.block_pool
        self.kvguard_pool = install_guarded_pool(
            self.kv_cache_manager,
            guard,
            ledger=self._kvguard_ledger,
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
            "zero policy: %s (block zeroing: %s); KV audit: %s; prefix caching: %s; "
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

    def _kvguard_name_window_frees(self) -> None:
        """Sliding-window, chunked-local and R-SWA groups free blocks of a running
        request: those that left its window or local chunk, or R-SWA's gap between its
        prompt and its window (vLLM's ``remove_skipped_blocks``). Their managers free
        them with ``block_pool.free_blocks(blocks)``: neither the request nor how the
        release should go reaches the pool. The coordinator's ``remove_skipped_blocks``
        -- the one entry of every window free, from ``allocate_slots`` and from
        ``_connector_finished`` -- is the one place that knows the request: wrapped, it
        names it for the pool's question (:meth:`_kvguard_window_frees`), asked about
        the blocks vLLM actually frees (most calls free none)."""
        coordinator = self.kv_cache_manager.coordinator
        remove_skipped = coordinator.remove_skipped_blocks

        def remove_skipped_blocks(
            request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
        ) -> None:
            self._kvguard_window = request_id
            try:
                remove_skipped(request_id, processed_computed_tokens, num_prompt_tokens)
            finally:
                self._kvguard_window = None

        coordinator.remove_skipped_blocks = remove_skipped_blocks

    def _kvguard_window_frees(self, block_ids: list[int]) -> bool | None:
        """The pool's question on every release: while vLLM frees a request's window,
        whether every step that wrote these blocks passed; otherwise None (the release
        goes as its caller said)."""
        window = self._kvguard_window
        return None if window is None else self._kvguard_window_free(window, block_ids)

    def _kvguard_window_free(self, request_id: str, block_ids: list[int]) -> bool:
        """vLLM frees these blocks of a running request's window (before releasing
        them): whether every step that wrote them passed.

        vLLM frees only blocks below the request's *processed* tokens, so every step
        that wrote them has reported: they are validated as they are released -- not
        quarantined and zeroed -- unless the request's last reported step is not known
        clean, or it holds connector-loaded KV no step vouched for yet.

        Under async scheduling the step that *cached* a block (the one after the step
        that completed it, once its last token was known) may still be in flight when
        a local chunk's end frees it. When the request is clean such blocks are
        validated and published now, not at that step's output (by then the block
        may be someone else's); either way they leave that step's record. A block
        whose cached tokens reach past what kvguard's ledger counts as reported is
        one a step in flight may still write: vLLM's contract is broken, and the
        blocks are quarantined (under ``check_invariants``: :class:`~kvguard.errors.
        EngineContractError`).
        """
        ledger = self._kvguard_ledger
        carried = ledger.carried.fills.get(request_id)
        clean = not carried and self._kvguard_reported_clean(request_id)
        freed = set(block_ids)
        in_flight = {b for b in ledger.fills_in_flight(request_id) if b in freed}
        if in_flight:
            pool = self.kvguard_pool
            reported = self._kvguard_reported_tokens(request_id)
            blocks = pool.blocks
            unreported = sorted(b for b in in_flight if blocks[b].num_hash_tokens > reported)
            if unreported:
                message = f"the window freed blocks {unreported} that a step in flight fills"
                if clean and pool.guard.check_invariants:
                    raise EngineContractError(
                        f"kvguard: {message} (request {request_id!r}, {reported} tokens "
                        "reported): vLLM frees a window only below a request's processed "
                        "tokens"
                    )
                if not self.kvguard_metrics.window_contract_breaks:
                    logger.warning("kvguard: %s; they are quarantined", message)
                self.kvguard_metrics.window_contract_breaks += 1
                clean = False
            taken, publications = ledger.take_fills(request_id, in_flight)
            if clean:
                pool.validate_fills(taken, publications)
        if carried:
            # Loaded blocks the window drops (quarantined: not clean) are no longer the
            # request's to vouch for.
            ledger.carried.drop(request_id, freed)
        return clean

    def _kvguard_reported_clean(self, request_id: str) -> bool:
        """Whether every step of the request that reported back was counted clean."""
        request = self.requests.get(request_id)
        if request is not None and request.is_finished():
            # Settled on its way out (a connector's request_finished frees its window
            # first): clean only with no step in flight -- the safe side.
            return request_id in self._kvguard_clean
        return request_id not in self._kvguard_unchecked and request_id not in self._kvguard_failing

    # ------------------------------------------------------------------ schedule

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        # The per-step cost is one record: blocks are marked WRITTEN when vLLM hands
        # them out, and the pool notes the blocks vLLM caches while it schedules the
        # step straight into the step's record.
        ledger = self._kvguard_ledger
        ledger.open()
        scheduler_output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        record = ledger.seal(scheduler_output, scheduler_output.num_scheduled_tokens)
        if self._kvguard_audit and record.fills:
            # The blocks this step publishes once it validates (a copy: the record's
            # lists change as requests leave, while a worker may still read these).
            fills = {r: list(ids) for r, ids in record.fills.items()}
            scheduler_output.kvguard_blocks_to_audit = fills
            self.kvguard_metrics.blocks_audited += sum(map(len, fills.values()))
        if self._kvguard_slots:  # after recover(): wiped before this step's forward
            scheduler_output.kvguard_slots_to_zero = self._kvguard_slots
            self._kvguard_slots = []
        return scheduler_output

    # ------------------------------------------------------------------ recovery

    @contextlib.contextmanager
    def kvguard_fault(self) -> Iterator[None]:
        """While vLLM's fault handler runs (the plugin wraps ``on_fault``): its abort of
        every request, ``finish_requests(None, FINISHED_ABORTED)``, recovers them
        instead, and returns only those that cannot resume."""
        self._kvguard_on_fault = True
        try:
            yield
        finally:
            self._kvguard_on_fault = False

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        if (
            self._kvguard_on_fault
            and request_ids is None
            and finished_status == RequestStatus.FINISHED_ABORTED
        ):
            self._kvguard_on_fault = False  # (recover() may finish requests itself)
            report = self.recover()
            if report.resumed:
                logger.warning(
                    "kvguard: engine fault: %d request(s) roll back to their validated "
                    "KV and resume after recovery (%d token(s) to recompute) instead of "
                    "being aborted",
                    len(report.resumed),
                    sum(r.rolled_back for r in report.resumed),
                )
            return [request for request, _ in report.ended]
        return super().finish_requests(request_ids, finished_status)  # type: ignore[misc]

    def recover(self, request_ids: Iterable[str] | None = None) -> RecoveryReport:
        """Roll requests whose steps in flight are lost back to their validated KV, so
        that they resume instead of being aborted (see :mod:`.recovery`).

        ``request_ids``: the requests to roll back (default: every request with a step
        in flight). Call it when those steps' outputs will never be processed -- after
        a fault, before the next ``schedule()``. Each request resumes from the end of
        the tokens its clean steps computed; the token slots past it are wiped on the
        workers before the next step. A request that cannot resume is finished with
        ``FINISHED_ERROR`` (logged with the reason) and returned in ``ended``: its
        client must be told, as for an abort.
        """
        ledger = self._kvguard_ledger
        resumed: list[ResumedRequest] = []
        unresumable: dict[str, str] = {}
        for req_id in requests_to_recover(self, request_ids):
            request = self.requests[req_id]
            if request.is_finished():
                continue
            in_flight = ledger.tokens_in_flight(req_id)
            if not in_flight:
                continue
            boundary = request.num_computed_tokens - in_flight
            reason = why_not_resumable(self, request, boundary)
            if reason is None:
                try:
                    roll_back_request(self, request, boundary)
                except RollbackError as exc:
                    reason = f"its KV cannot be rolled back ({exc})"
            if reason is not None:
                unresumable[req_id] = reason
                continue
            resumed.append(ResumedRequest(req_id, boundary, in_flight))
        ended = []
        if unresumable:
            for request in self._kvguard_finish_failing(dict.fromkeys(unresumable, 0)):
                reason = unresumable[request.request_id]
                logger.warning(
                    "kvguard: request %s cannot resume after the fault (finish reason "
                    "'error'): %s; its KV past its last validated step is quarantined",
                    request.request_id,
                    reason,
                )
                ended.append((request, reason))
        # kvguard's pool queued the slots to wipe; they travel with the next step.
        slots = self.kvguard_pool.core.take_slots_to_zero()
        self._kvguard_slots += slots
        metrics = self.kvguard_metrics
        metrics.requests_recovered += len(resumed)
        metrics.tokens_rolled_back += sum(r.rolled_back for r in resumed)
        metrics.requests_unrecoverable += len(ended)
        return RecoveryReport(tuple(resumed), tuple(ended), tuple(slots))

    def _get_new_block_ids_to_zero(self) -> list[int] | None:
        ids: list[int] | None = super()._get_new_block_ids_to_zero()  # type: ignore[misc]
        ours = self.kvguard_pool.take_blocks_to_zero()
        if not ours:
            return ids
        self.kvguard_metrics.blocks_zeroed += len(ours)
        return list(dict.fromkeys([*ids, *ours])) if ids else ours

    # ------------------------------------------------------------------ outputs

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        pool = self.kvguard_pool
        ledger = self._kvguard_ledger
        record = ledger.close(scheduler_output)
        if record is None:
            record = self._kvguard_resync(scheduler_output)
        scheduled = record.scheduled
        nans = model_runner_output.num_nans_in_logits
        if nans is None:
            if scheduled:
                raise GuardConfigError(
                    f"a step's output carries no NaN counts; set {NAN_SETTING}=1 for the workers"
                )
            nans = {}
        metrics = self.kvguard_metrics
        dropped = record.dropped
        requests = self.requests
        # A clean step (the common case) costs one C-level pass over the counts.
        failed = (
            {
                r: c
                for r, c in nans.items()
                if c and r in scheduled and r not in dropped and r in requests
            }
            if any(nans.values())
            else {}
        )
        if self._kvguard_poisoned_loads[0] or self._kvguard_poisoned_loads[1]:
            self._kvguard_report_poisoned_loads(model_runner_output)
        connector_output = model_runner_output.kv_connector_output
        suspect = (
            self._kvguard_load_failures(connector_output, record)
            if connector_output is not None
            else _NONE
        )
        waiting = self._kvguard_unchecked
        if waiting:  # a step counted clean vouches for the earlier unchecked ones
            waiting.difference_update([r for r in waiting if nans.get(r) == 0])
        unchecked: set[str] | frozenset[str] = _NONE
        if len(nans) < len(scheduled):
            # vLLM left these requests out of the counts: their step is not known to
            # be clean, so nothing it filled is validated now (see the carry below).
            unchecked = {r for r in scheduled if r not in nans and r not in dropped}
            metrics.steps_unchecked += len(unchecked)
            waiting.update(unchecked)
        metrics.steps_validated += len(scheduled) - len(dropped) - len(failed) - len(unchecked)
        fills = record.fills
        if fills:
            ids: list[int] = []
            for req_id, filled in fills.items():
                if req_id in failed or req_id in suspect:
                    continue
                if req_id not in scheduled or req_id in unchecked:
                    # Filled without a step (KV a connector finished loading), or by a
                    # step that came back without a NaN count: the request's next
                    # counted step, computing on it, vouches for it.
                    ledger.carried.add(req_id, filled, record.publications)
                    continue
                ids += filled
            if ids:
                pool.validate_fills(ids, record.publications)
        for req_id in suspect:
            # Computed on KV that failed to load: vLLM recomputes or fails the request
            # itself; what this step filled is never trusted.
            pool.fail_fills([*fills.get(req_id, ()), *ledger.later_fills(req_id)])
        aborted = []
        if failed:
            spans = self._kvguard_failed_spans(failed, scheduled)
            for req_id in failed:
                pool.fail_fills([*fills.get(req_id, ()), *ledger.later_fills(req_id)])
            # Finished before vLLM sees the output: its tokens come from NaN logits and
            # are not delivered; everything else in the batch proceeds as usual. Their
            # unvalidated blocks (the partial tail) are quarantined on release.
            aborted = self._kvguard_finish_failing(failed)
            metrics.requests_aborted += len(aborted)
            kv_audit = getattr(nans, "kv_audit", None)
            if kv_audit:
                metrics.requests_failed_audit += sum(1 for r in failed if r in kv_audit)
            self._kvguard_log_aborts(aborted, failed, spans, kv_audit, fills)
        # Stores waiting for this step's verdict (GuardedExampleConnector) are
        # committed or deleted now, before vLLM counts the step in its stats.
        for settle_stores in self._kvguard_settle_stores:
            settle_stores()
        # The blocks vLLM caches while it processes the output are validated with it
        # when every write into them reported clean (the ledger's ``settles``: before
        # any block is freed, and here), else carried to the request's next step.
        try:
            outputs = super().update_from_output(  # type: ignore[misc]
                scheduler_output, model_runner_output
            )
        finally:
            pool.validate_settled()
        if ledger.noted.fills:
            self._kvguard_carry_late_fills(ledger.take_noted())
        for request in aborted:
            eco = outputs.get(request.client_index)
            if eco is None:
                eco = outputs[request.client_index] = EngineCoreOutputs()
            eco.outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    events=request.take_events(),
                    trace_headers=request.trace_headers,
                    num_nans_in_logits=failed[request.request_id],
                )
            )
        return outputs

    def _kvguard_finish_failing(self, failing: dict[str, int]) -> list[Any]:
        """Finish ``failing`` (request id -> NaN count) with ``FINISHED_ERROR`` as
        requests that never settled clean: what they wrote past their last validated
        step is quarantined as their blocks are released. Returns vLLM's requests."""
        self._kvguard_failing = failing
        try:
            finished: list[Any] = self.finish_requests(list(failing), RequestStatus.FINISHED_ERROR)
        finally:
            self._kvguard_failing = {}
        return finished

    def _kvguard_failed_spans(
        self, failed: dict[str, int], scheduled: Mapping[str, int]
    ) -> dict[str, tuple[int, int]]:
        """The token positions ``[start, end)`` each failed request's step computed
        (its tokens past those of its steps still in flight; vLLM counts scheduled
        tokens as computed when it schedules them). Failures only: off the hot path."""
        spans = {}
        for req_id in failed:
            end = self._kvguard_reported_tokens(req_id)
            spans[req_id] = (end - scheduled[req_id], end)
        return spans

    def _kvguard_log_aborts(
        self,
        aborted: list[Any],
        failed: dict[str, int],
        spans: dict[str, tuple[int, int]],
        kv_audit: Mapping[str, int] | None,
        fills: Mapping[str, list[int]],
    ) -> None:
        """One WARNING per request the guard finished with an error, with its cause:
        ``kv_audit`` is what the worker says the KV audit flagged (None where its counts
        do not tell it apart from NaN logits); ``fills``, the blocks the step filled."""
        for request in aborted:
            req_id = request.request_id
            start, end = spans[req_id]
            logger.warning(
                "kvguard: aborted request %s (finish reason 'error'): the step computing "
                "its positions %d..%d (prompt %d tokens, %d output token(s)) had %s; its "
                "tokens are not delivered, and its KV past its last validated step is "
                "quarantined (never cached or offloaded, zeroed before reuse)",
                req_id,
                start,
                end - 1,
                request.num_prompt_tokens,
                request.num_output_tokens,
                self._kvguard_cause(req_id, failed[req_id], kv_audit, fills),
            )

    def _kvguard_cause(
        self,
        req_id: str,
        count: int,
        kv_audit: Mapping[str, int] | None,
        fills: Mapping[str, list[int]],
    ) -> str:
        """What made the request's step fail, from its count (NaN logits plus, with the
        KV audit, the blocks it flagged)."""
        if not (self._kvguard_audit and fills.get(req_id)):
            return f"{count} NaN logit(s)"  # no block of it was audited
        if kv_audit is None:  # the worker summed them on the device
            return f"{count} NaN logit(s) or non-finite KV block(s) (KV audit)"
        flagged = kv_audit.get(req_id, 0)
        if not flagged:
            return f"{count} NaN logit(s)"
        nan_logits = count - flagged
        return f"NaN or infinite KV in {flagged} block(s) it filled (KV audit)" + (
            f" and {nan_logits} NaN logit(s)" if nan_logits else "; its logits were finite"
        )

    def _kvguard_resync(self, scheduler_output: Any) -> StepRecord:
        """The record of an output that is not the oldest step in flight.

        Outputs arrive in step order, so the steps scheduled before this one never
        report back: vLLM's engine fault tolerance aborted every request and dropped
        the outputs of the steps in flight (0.33 hands their connector reports over
        with ``SchedulerOutput.make_empty()``). Those steps are dropped from the
        ledger; a request of theirs still running (not expected: the fault aborted
        them all) is treated as if its step came back without a NaN count. An output
        the ledger never saw -- such an empty step -- is checked like any other, with
        nothing recorded to validate."""
        ledger = self._kvguard_ledger
        lost = ledger.skip_to(scheduler_output)
        for step in lost:
            for req_id in {*step.scheduled, *step.fills}:
                request = self.requests.get(req_id)
                if req_id in step.dropped or request is None or request.is_finished():
                    continue
                self._kvguard_unchecked.add(req_id)
                filled = step.fills.get(req_id)
                if filled:
                    ledger.carried.add(req_id, filled, step.publications)
        if lost:
            self.kvguard_metrics.steps_lost += len(lost)
            logger.warning(
                "kvguard: %d scheduled step(s) never reported back (engine fault "
                "tolerance?); the guard resumes with the next output",
                len(lost),
            )
            record = ledger.close(scheduler_output)
            assert record is not None
            return record
        return StepRecord(scheduler_output, scheduler_output.num_scheduled_tokens)

    def _kvguard_load_failures(self, kv_connector_output: Any, record: Any) -> set[str]:
        """Requests of this step whose KV (partly) failed to load from a connector."""
        out = set(kv_connector_output.failed_recving or ())
        invalid = kv_connector_output.invalid_block_ids
        if invalid:
            for req_id in record.scheduled:
                if req_id in self.requests:
                    groups = self.kv_cache_manager.get_block_ids(req_id)
                    if any(b in invalid for group in groups for b in group):
                        out.add(req_id)
        return out

    def _kvguard_fill_settled(self, request_id: str, num_tokens: int) -> bool:
        """Whether blocks covering the request's first ``num_tokens`` tokens, cached
        while vLLM processes an output, were written by steps that all reported and
        were counted clean (a failing request was finished before vLLM processes the
        output, and vLLM caches for running ones only). What reported is counted from
        kvguard's ledger. With the KV audit on, never: no step audited them (the
        request's next step does, as for a carried fill)."""
        if self._kvguard_audit or request_id in self._kvguard_unchecked:
            return False
        if request_id in self._kvguard_ledger.carried.fills:
            return False
        return num_tokens <= self._kvguard_reported_tokens(request_id)

    def _kvguard_reported_tokens(self, request_id: str) -> int:
        """The request's tokens whose steps have all reported back, counted from
        kvguard's ledger (its computed tokens minus those of its steps in flight);
        -1 for a request vLLM no longer holds."""
        request = self.requests.get(request_id)
        if request is None:
            return -1
        return int(request.num_computed_tokens) - self._kvguard_ledger.tokens_in_flight(request_id)

    def _kvguard_carry_late_fills(self, late: HeldFills) -> None:
        """Blocks cached while an output was processed that could not be validated
        then (the request's last step had no NaN count, or it holds unvouched loaded
        KV): the request's next counted step vouches for them, as for a connector's
        loads. A request that left already released them (quarantined)."""
        carried = self._kvguard_ledger.carried
        for req_id, ids in late.fills.items():
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished():
                carried.add(req_id, ids, late.publications)

    # ------------------------------------------------------------------ release

    def _kvguard_settle(self, request: Any) -> None:
        """The request leaves (finished or preempted); its blocks are released next,
        now or -- held by a connector -- later.

        With no step of it in flight, not failing, and its last step counted (not
        unchecked), its last step was clean: the blocks it wrote that no step
        validated (the partial tail) are validated as they are released, so the
        release frees them plainly. Otherwise they stay WRITTEN and the release
        quarantines them (zeroed before reuse). Every in-flight step forgets it.
        """
        req_id = request.request_id
        ledger = self._kvguard_ledger
        unchecked = self._kvguard_unchecked
        if unchecked and req_id in unchecked:
            unchecked.discard(req_id)
            self._kvguard_clean.discard(req_id)  # its last step was never counted
        elif req_id not in self._kvguard_failing and not ledger.in_flight(req_id):
            self._kvguard_clean.add(req_id)
        else:
            self._kvguard_clean.discard(req_id)
        ledger.forget(req_id)

    def _free_request_blocks(self, request: Any) -> None:
        # Preemption (finished requests were settled in _free_request, possibly long
        # before a connector let their blocks go).
        if not request.is_finished():
            self._kvguard_settle(request)
        req_id = request.request_id
        clean = self._kvguard_clean
        if req_id not in clean:
            super()._free_request_blocks(request)  # type: ignore[misc]
            return
        clean.discard(req_id)
        if not self._request_blocks_can_be_freed(request):  # type: ignore[attr-defined]
            # vLLM parks the blocks until a step still in flight is done
            # (defer_block_free) and releases them later as it releases any block:
            # quarantined, the safe side. (A request with no step in flight is never
            # parked.)
            super()._free_request_blocks(request)  # type: ignore[misc]
            return
        # vLLM's KVCacheManager.free(request) -- each group's blocks, tail first --
        # saying how the release goes: the request's last step was clean.
        pool = self.kvguard_pool
        for manager in self.kv_cache_manager.coordinator.single_type_managers:
            pool.free_blocks(reversed(manager.pop_blocks_for_free(req_id)), steps_passed=True)

    def _connector_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        # The request-finished gate (kvguard.adapters.vllm.exits.coverage): only a
        # request that ended after clean, counted steps is handed to the connector.
        finished = super()._connector_finished  # type: ignore[misc]
        if request.request_id in self._kvguard_clean or self.connector is None:
            return finished(request)
        if request.status in NORMAL_ENDS:
            self.kvguard_metrics.connector_handoffs_withheld += 1
        return withhold_from_connector(finished, request)

    def _free_request(self, request: Any, delay_free_blocks: bool = False) -> Any:
        self._kvguard_settle(request)
        return super()._free_request(  # type: ignore[misc]
            request, delay_free_blocks=delay_free_blocks
        )

    # ------------------------------------------------------------------ invalidation

    def kvguard_invalidate(
        self, block_hashes: Iterable[bytes], *, descendants: bool = True
    ) -> TierPurgeReport:
        """KV found corrupt after the fact: taint vLLM's block hashes (as in
        ``Request.block_hashes``) in every KV cache group. Blocks holding them leave
        the prefix cache and are quarantined, the requests holding them are aborted
        (kvguard's record; vLLM's requests run on unless the caller finishes them),
        and every tier copy of them is purged from the tier that holds it (the
        guarded connectors' CPU tiers and stores). With ``descendants``, the hashes
        chained after them too: their KV was computed attending to the corrupt KV."""
        groups = len(self.kv_cache_config.kv_cache_groups)
        keys = [BlockHash(h + group_suffix(g)) for h in block_hashes for g in range(groups)]
        report = self.kvguard_pool.invalidate(keys, descendants=descendants)
        self._kvguard_poison_loads(set(report.invalidation.hashes))
        self.kvguard_metrics.tier_copies_purged += report.copies_purged
        logger.warning(
            "kvguard: invalidated %d block hash(es): %d block(s) quarantined, %d tier "
            "cop(ies) purged (%s)",
            len(report.invalidation.hashes),
            len(report.invalidation.block_ids),
            report.copies_purged,
            ", ".join(f"{tier}: {len(h)}" for tier, h in sorted(report.purged.items()))
            or "no tier held one",
        )
        return report

    def _kvguard_poison_loads(self, tainted: set[BlockHash]) -> None:
        """Requests loading KV of a ``tainted`` hash (waiting for a connector's load),
        or holding such loaded KV no step vouched for yet: the invalidation cannot
        reach it (its blocks carry no hash until a step validates them), so the next
        output reports it to vLLM as a failed load, which vLLM recomputes or fails
        (``kv_load_failure_policy``)."""
        waiting, blocks = self._kvguard_poisoned_loads
        carried = self._kvguard_ledger.carried.fills
        hash_block_size = self.kvguard_pool.hash_block_size
        managers = self.kv_cache_manager.coordinator.single_type_managers
        for req_id, request in self.requests.items():
            loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            if not loading and req_id not in carried:
                continue
            hit = []
            for group_id, manager in enumerate(managers):
                if manager.block_size != hash_block_size:
                    continue  # (no connector loads such a group's blocks by hash)
                suffix = group_suffix(group_id)
                for block, block_hash in zip(
                    manager.req_to_blocks.get(req_id, ()), request.block_hashes, strict=False
                ):
                    if not block.is_null and BlockHash(block_hash + suffix) in tainted:
                        hit.append(block.block_id)
            if not hit:
                continue
            if loading:
                waiting.add(req_id)
            elif len(managers) == 1:  # (vLLM maps block ids to requests in one group only)
                blocks.update(hit)
            else:
                logger.warning(
                    "kvguard: request %s holds loaded KV invalidated before a step vouched "
                    "for it; on a model with several KV cache groups vLLM cannot be told "
                    "which blocks failed, so it is not recomputed",
                    req_id,
                )

    def _kvguard_report_poisoned_loads(self, model_runner_output: Any) -> None:
        """Add the loads :meth:`_kvguard_poison_loads` found to this output's failed
        loads, as the workers would report them."""
        waiting, blocks = self._kvguard_poisoned_loads
        self._kvguard_poisoned_loads = (set(), set())
        output = model_runner_output.kv_connector_output
        if output is None:
            output = model_runner_output.kv_connector_output = KVConnectorOutput()
        output.failed_recving = set(output.failed_recving or ()) | waiting
        output.invalid_block_ids = set(output.invalid_block_ids or ()) | blocks

    def kvguard_invalidate_tokens(
        self, token_ids: Sequence[int], *, descendants: bool = True
    ) -> TierPurgeReport:
        """:meth:`kvguard_invalidate` for the full blocks of a token prefix (a plain
        text prompt: no multimodal inputs, LoRA or cache salt in its hashes), hashed
        as vLLM hashes a prompt's blocks."""
        block_size = self.kvguard_pool.hash_block_size
        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        hashes: list[bytes] = []
        parent = None
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            parent = hash_block_tokens(hash_fn, parent, token_ids[start : start + block_size])
            hashes.append(parent)
        return self.kvguard_invalidate(hashes, descendants=descendants)

    # ------------------------------------------------------------------ metrics

    def make_stats(self, *args: Any, **kwargs: Any) -> Any:
        # vLLM's stats travel to the front end (API server), which serves /metrics;
        # kvguard's counters go with them (kvguard.adapters.vllm.metrics).
        stats = super().make_stats(*args, **kwargs)  # type: ignore[misc]
        if stats is not None:
            self._kvguard_stats_sender.attach(stats, self)
        return stats

    def kvguard_stats(self) -> dict[str, int]:
        """The guard's counters: the adapter's plus kvguard's pool counters."""
        out = self.kvguard_metrics.as_dict()
        counters = self.kvguard_pool.core.counters()  # (stats() would walk every block)
        out["blocks_quarantined"] = counters.blocks_quarantined
        out["deferred_publications"] = counters.deferred_publications
        out["dropped_acks"] = counters.dropped_acks
        out["blocks_published"] = counters.blocks_published
        out["stores_started"] = counters.stores_started
        out["stores_acknowledged"] = counters.stores_acknowledged
        out.update(connector_counters(self) or {})
        return out


class GuardedScheduler(_GuardMixin, Scheduler):
    """vLLM's synchronous ``Scheduler`` with kvguard's validation gate (with the guard
    off, building one builds vLLM's ``Scheduler``)."""

    _vllm_scheduler = Scheduler


class GuardedAsyncScheduler(_GuardMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with kvguard's validation gate (with the guard off,
    building one builds vLLM's ``AsyncScheduler``)."""

    _vllm_scheduler = AsyncScheduler
