"""Guarded schedulers: vLLM's ``Scheduler`` / ``AsyncScheduler`` on kvguard's pool.

Select with ``SchedulerConfig.scheduler_cls`` (``--scheduler-cls``)::

    kvguard.adapters.vllm.scheduler.GuardedScheduler
    kvguard.adapters.vllm.scheduler.GuardedAsyncScheduler

What changes against vLLM (everything else is vLLM's own code path):

* ``schedule``: after vLLM scheduled the step, the blocks each request's step writes
  are recorded as WRITTEN (kvguard). Full blocks vLLM caches now are only *marked* for
  publication.
* ``update_from_output``: before vLLM processes the output, every request whose row
  in ``num_nans_in_logits`` is non-zero is finished with ``FINISHED_ERROR`` (its
  client sees finish reason ``"error"``, its NaN-derived tokens are never delivered)
  and the blocks its in-flight steps wrote are QUARANTINED; every other request's
  blocks are validated, and the blocks marked for publication enter the prefix cache
  only then. Requests freed or preempted before their output arrived are forgotten:
  their unvalidated blocks are quarantined on release.
* ``new_block_ids_to_zero`` carries kvguard's zero queue (quarantined blocks being
  reused, or every new block under ``zero_policy=all``), whatever vLLM's
  ``needs_kv_cache_zeroing`` says.
"""

from __future__ import annotations

from typing import Any

from kvguard.adapters.vllm._compat import require_supported_vllm

require_supported_vllm()

import vllm.envs as envs  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from .config import GuardConfig, GuardConfigError  # noqa: E402
from .ledger import StepLedger  # noqa: E402
from .manager import install_guarded_pool  # noqa: E402
from .metrics import GuardMetrics  # noqa: E402

NAN_SETTING = "VLLM_COMPUTE_NANS_IN_LOGITS"


class _GuardMixin:
    """The guard's hooks; mixed in front of vLLM's scheduler classes."""

    # Attributes of vLLM's Scheduler this mixin reads (typed loosely: vLLM is untyped).
    kv_cache_manager: Any
    requests: dict[str, Any]
    vllm_config: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        guard = GuardConfig.from_vllm(self.vllm_config.additional_config)
        if guard.enabled and not envs.VLLM_COMPUTE_NANS_IN_LOGITS:
            raise GuardConfigError(
                f"kvguard validates each step by its per-request NaN logit counts, which "
                f"vLLM computes only with {NAN_SETTING}=1 in the environment of the engine "
                f"and its workers. Set {NAN_SETTING}=1, or KVGUARD_GUARD=0 to run the "
                "scheduler in pass-through mode."
            )
        self.kvguard_pool = install_guarded_pool(self.kv_cache_manager, guard)
        self.kvguard_metrics = GuardMetrics()
        self._kvguard_ledger = StepLedger()
        # Requests that had a step recorded since their blocks were (re)allocated.
        self._kvguard_started: set[str] = set()

    # ------------------------------------------------------------------ schedule

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        scheduler_output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        pool = self.kvguard_pool
        if pool.core is None:
            return scheduler_output
        record = self._kvguard_ledger.open(scheduler_output)
        managers = self.kv_cache_manager.coordinator.single_type_managers
        requests = self.requests
        started = self._kvguard_started
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            # _update_after_schedule already advanced num_computed_tokens past this step.
            end = requests[req_id].num_computed_tokens
            start = end - num_tokens
            first = req_id not in started
            ids: list[int] = []
            for manager in managers:
                blocks = manager.req_to_blocks.get(req_id)
                if not blocks:
                    continue
                size = manager.block_size
                # A request's first step also vouches for blocks filled without a step
                # (KV loaded by a connector): their KV feeds this step's logits.
                lo = 0 if first else start // size
                ids += pool.writable_ids(blocks, lo, min(len(blocks), -(-end // size)))
            started.add(req_id)
            if ids:
                pool.record_step(ids)
            record.writes[req_id] = ids
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
        record = None
        if pool.core is not None:
            record = self._kvguard_ledger.close(scheduler_output)
        if record is None:
            return super().update_from_output(  # type: ignore[misc]
                scheduler_output, model_runner_output
            )
        nans = model_runner_output.num_nans_in_logits
        if nans is None and record.writes:
            raise GuardConfigError(
                f"a step's output carries no NaN counts; set {NAN_SETTING}=1 for the workers"
            )
        metrics = self.kvguard_metrics
        suspect = self._kvguard_load_failures(model_runner_output.kv_connector_output, record)
        failed: dict[str, int] = {}
        for req_id, ids in record.writes.items():
            count = nans.get(req_id) if nans is not None else 0
            if count is None:
                metrics.steps_unchecked += 1
                count = 0
            if count > 0:
                failed[req_id] = count
            elif req_id in suspect:
                # Computed on KV that failed to load: vLLM recomputes or fails the
                # request itself; what this step wrote is never trusted.
                pool.fail_step([*ids, *self._kvguard_ledger.later_writes(req_id)])
            else:
                if ids:
                    pool.validate_step(ids)
                metrics.steps_validated += 1
        aborted = []
        if failed:
            for req_id in failed:
                pool.fail_step([*record.writes[req_id], *self._kvguard_ledger.later_writes(req_id)])
            # Finished before vLLM sees the output: its tokens come from NaN logits and
            # are not delivered; everything else in the batch proceeds as usual.
            aborted = self.finish_requests(  # type: ignore[attr-defined]
                failed, RequestStatus.FINISHED_ERROR
            )
            metrics.requests_aborted += len(aborted)
        outputs = super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output
        )
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

    def _kvguard_load_failures(self, kv_connector_output: Any, record: Any) -> set[str]:
        """Requests of this step whose KV (partly) failed to load from a connector."""
        if kv_connector_output is None:
            return set()
        out = set(kv_connector_output.failed_recving or ())
        invalid = kv_connector_output.invalid_block_ids
        if invalid:
            for req_id in record.writes:
                if req_id in self.requests:
                    groups = self.kv_cache_manager.get_block_ids(req_id)
                    if any(b in invalid for group in groups for b in group):
                        out.add(req_id)
        return out

    # ------------------------------------------------------------------ release

    def _kvguard_forget(self, request_id: str) -> None:
        self._kvguard_ledger.forget(request_id)
        self._kvguard_started.discard(request_id)

    def _free_request_blocks(self, request: Any) -> None:
        # Preemption and finishing: in-flight steps of the request can never validate
        # it any more; kvguard quarantines their blocks when they are released.
        self._kvguard_forget(request.request_id)
        super()._free_request_blocks(request)  # type: ignore[misc]

    def _free_request(self, request: Any, delay_free_blocks: bool = False) -> Any:
        self._kvguard_forget(request.request_id)
        return super()._free_request(  # type: ignore[misc]
            request, delay_free_blocks=delay_free_blocks
        )

    # ------------------------------------------------------------------ metrics

    def kvguard_stats(self) -> dict[str, int]:
        """The guard's counters: the adapter's plus kvguard's pool counters."""
        out = self.kvguard_metrics.as_dict()
        core = self.kvguard_pool.core
        if core is not None:
            counters = core.stats().counters
            out["blocks_quarantined"] = counters.blocks_quarantined
            out["withheld_publications"] = counters.withheld_publications
            out["dropped_acks"] = counters.dropped_acks
            out["blocks_published"] = counters.blocks_published
        return out


class GuardedScheduler(_GuardMixin, Scheduler):
    """vLLM's synchronous ``Scheduler`` with kvguard's validation gate."""


class GuardedAsyncScheduler(_GuardMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with kvguard's validation gate."""
