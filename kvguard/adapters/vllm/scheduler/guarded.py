"""Guarded schedulers: vLLM's ``Scheduler`` / ``AsyncScheduler`` on kvguard's pool.

Select with ``SchedulerConfig.scheduler_cls`` (``--scheduler-cls``)::

    kvguard.adapters.vllm.scheduler.GuardedScheduler
    kvguard.adapters.vllm.scheduler.GuardedAsyncScheduler

What changes against vLLM (everything else is vLLM's own code path):

* ``schedule``: blocks vLLM hands out are WRITTEN (kvguard) from then on; full blocks
  vLLM caches while scheduling the step are only *marked* for publication (the pool
  holds it back and puts the blocks in its outbox) and noted as filled by this step
  (one record per step in the scheduler's
  :class:`~kvguard.adapters.vllm.scheduler.step_ledger.StepLedger`, no per-request work).
  One step's data goes one way: recorded when it is scheduled, closed when its output
  arrives, applied to the pool once.
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

from collections.abc import Mapping
from typing import Any

from kvguard.adapters.vllm._compat import require_supported_vllm

require_supported_vllm()

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvguard.adapters.vllm.config import NAN_SETTING, GuardConfigError  # noqa: E402
from kvguard.adapters.vllm.exits.gate import (  # noqa: E402
    NORMAL_ENDS,
    withhold_from_connector,
)
from kvguard.adapters.vllm.exits.handoff import expect_handoff_seals, seal_handoff  # noqa: E402
from kvguard.adapters.vllm.scheduler.invalidation import _Invalidation  # noqa: E402
from kvguard.adapters.vllm.scheduler.recovery import _Recovery  # noqa: E402
from kvguard.adapters.vllm.scheduler.startup import _GuardStartUp, logger  # noqa: E402
from kvguard.adapters.vllm.scheduler.stats import _Stats  # noqa: E402
from kvguard.adapters.vllm.scheduler.step_ledger import HeldFills, StepRecord  # noqa: E402
from kvguard.adapters.vllm.scheduler.windows import _WindowFrees  # noqa: E402

__all__ = ["GuardedAsyncScheduler", "GuardedScheduler", "logger"]

_NONE: frozenset[str] = frozenset()


class _StepVerdict(_GuardStartUp):
    """Each step's verdict: its record opened at ``schedule``, its NaN counts read at
    ``update_from_output`` (failing requests finished, the others' fills validated), and
    how a leaving request's blocks are released."""

    # ------------------------------------------------------------------ schedule

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        # The per-step cost is one record: blocks are marked WRITTEN when vLLM hands
        # them out, and the blocks vLLM caches while it schedules the step go from
        # the pool's outbox into the step's record.
        ledger = self._kvguard_ledger
        self._kvguard_take_cached()  # (a schedule() that raised left its own: dropped)
        ledger.open()
        scheduler_output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        scheduled = scheduler_output.num_scheduled_tokens
        self._kvguard_take_cached(scheduled)
        record = ledger.seal(scheduler_output, scheduled)
        if (self._kvguard_audit or self._kvguard_seal) and record.fills:
            # The blocks this step publishes once it validates (a copy: the record's
            # lists change as requests leave, while a worker may still read these).
            fills = {r: list(ids) for r, ids in record.fills.items()}
            if self._kvguard_audit:
                scheduler_output.kvguard_blocks_to_audit = fills
                self.kvguard_metrics.blocks_audited += sum(map(len, fills.values()))
            if self._kvguard_seal:
                scheduler_output.kvguard_blocks_to_seal = fills
        if self._kvguard_seal and scheduler_output.kv_connector_metadata is not None:
            # Reads of KV a prefill instance handed over: verified by their seals.
            self._kvguard_handoffs.update(
                expect_handoff_seals(scheduler_output.kv_connector_metadata, self.requests)
            )
        if self._kvguard_slots:  # after recover(): wiped before this step's forward
            scheduler_output.kvguard_slots_to_zero = self._kvguard_slots
            self._kvguard_slots = []
        return scheduler_output

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
        if self._kvguard_poisoned_loads[0] or self._kvguard_poisoned_loads[1]:
            self._kvguard_report_poisoned_loads(model_runner_output)
        connector_output = model_runner_output.kv_connector_output
        suspect = (
            self._kvguard_load_failures(connector_output, record)
            if connector_output is not None
            else _NONE
        )
        # A clean step (the common case) costs one C-level pass over the counts. (A
        # request whose load failed is vLLM's to recompute or fail -- its step's output
        # is dropped -- whatever its count: NaN there came from the KV that failed.)
        failed = (
            {
                r: c
                for r, c in nans.items()
                if c and r in scheduled and r not in dropped and r in requests and r not in suspect
            }
            if any(nans.values())
            else {}
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
                    ledger.carried.add(req_id, filled)
                    continue
                ids += filled
            if ids:
                # (With seals on, the workers' seals of the step's fills ride on the counts.)
                pool.validate_fills(ids, getattr(nans, "seals", None))
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
        if self._kvguard_handoffs and connector_output is not None:
            self._kvguard_count_refused_handoffs(connector_output)
        # Stores waiting for this step's verdict (GuardedExampleConnector) are
        # committed or deleted now, before vLLM counts the step in its stats.
        for settle_stores in self._kvguard_settle_stores:
            settle_stores(connector_output)
        # The blocks vLLM caches while it processes the output are validated with it
        # when every write into them reported clean (the ledger's ``settles``: taken
        # before a request leaves, and here), else carried to the request's next step.
        try:
            outputs = super().update_from_output(  # type: ignore[misc]
                scheduler_output, model_runner_output
            )
        finally:
            self._kvguard_take_cached()
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
                    ledger.carried.add(req_id, filled)
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

    def _kvguard_count_refused_handoffs(self, connector_output: Any) -> None:
        """Count the reads of handed-over KV the workers refused (their blocks reported
        failed to load; the worker logged why); a read reported done is no longer
        tracked."""
        handoffs = self._kvguard_handoffs
        invalid = connector_output.invalid_block_ids
        if invalid:
            for req_id in [r for r, blocks in handoffs.items() if not invalid.isdisjoint(blocks)]:
                del handoffs[req_id]
                self.kvguard_metrics.handoffs_refused += 1
        for req_id in connector_output.finished_recving or ():
            handoffs.pop(req_id, None)

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

    def _kvguard_take_cached(self, scheduled: Mapping[str, int] | None = None) -> None:
        """Take what vLLM cached since the last call out of the pool's outbox into the
        ledger: while a step is being scheduled, that step's fills; otherwise (an output
        being processed) blocks that settle -- validated now -- or wait for their
        request's next step. Called where the scheduler controls the moment: around
        vLLM's scheduling of a step, before a request leaves or a window frees its
        blocks, and after an output is processed.

        A copy-on-write that took over an entry is published when every step that
        computed the state it copies was counted clean, else its entry withdrawn.
        ``scheduled``: after vLLM scheduled a step, its tokens per request, which vLLM
        counts as computed already (the copies were made before it did)."""
        pool = self.kvguard_pool
        if not (pool.cached_fills or pool.cached_copies):
            return  # (the common case: a read of the outbox, no call)
        ledger = self._kvguard_ledger
        ledger.note_cached(pool.take_cached())
        for owner, block_id, num_tokens in pool.take_copies():
            ahead = scheduled.get(owner, 0) if scheduled else 0
            if self._kvguard_fill_settled(owner, num_tokens + ahead):
                pool.validate_fills([block_id])
            else:
                pool.withdraw([block_id])
        if ledger.settled:
            pool.validate_fills(ledger.take_settled())

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
                carried.add(req_id, ids)

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
        self._kvguard_take_cached()  # what vLLM cached for it just before, first
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
        # The request-finished gate (kvguard.adapters.vllm.exits.gate): only a
        # request that ended after clean, counted steps is handed to the connector.
        finished = super()._connector_finished  # type: ignore[misc]
        if request.request_id in self._kvguard_clean or self.connector is None:
            delay_free, params = finished(request)
            if self._kvguard_seal:
                seal_handoff(params, self.kvguard_pool.core.block_seal)
            return delay_free, params
        if request.status in NORMAL_ENDS:
            self.kvguard_metrics.connector_handoffs_withheld += 1
        return withhold_from_connector(finished, request)

    def _free_request(self, request: Any, delay_free_blocks: bool = False) -> Any:
        self._kvguard_settle(request)
        return super()._free_request(  # type: ignore[misc]
            request, delay_free_blocks=delay_free_blocks
        )


class GuardedScheduler(_StepVerdict, _Recovery, _Invalidation, _WindowFrees, _Stats, Scheduler):
    """vLLM's synchronous ``Scheduler`` with kvguard's validation gate (with the guard
    off, building one builds vLLM's ``Scheduler``)."""

    _vllm_scheduler = Scheduler


class GuardedAsyncScheduler(
    _StepVerdict, _Recovery, _Invalidation, _WindowFrees, _Stats, AsyncScheduler
):
    """vLLM's ``AsyncScheduler`` with kvguard's validation gate (with the guard off,
    building one builds vLLM's ``AsyncScheduler``)."""

    _vllm_scheduler = AsyncScheduler
