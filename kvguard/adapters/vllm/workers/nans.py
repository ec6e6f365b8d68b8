"""Per-request NaN counts in vLLM's model runners: what lets a step validate under
speculative decoding.

vLLM 0.33 counts NaN logits per logits *row* and reports row ``i`` as the ``i``-th
request's count (the V1 runner's ``nans_to_dict``, the V2 runner's output zipping its
counts with the request ids). Without draft tokens a request owns one row and that is
right. With them a decoding request owns ``1 + drafts`` consecutive rows, so the counts
name the wrong requests and the rows past the batch size are never reported: the guard
would validate KV computed alongside NaN logits.

:func:`install` (run by kvguard's plugin, ``KVGUARD_GUARD=1``, in every process vLLM
starts) makes both runners count per request, summing each request's rows -- a NaN in
any of its rows, a rejected draft's included, fails the request (its step computed on
something broken). A step without draft rows runs vLLM's code unchanged:

* **V1** (``vllm.v1.worker.gpu_model_runner``): while ``_bookkeeping_sync`` books a step
  with drafts, the module's ``count_nans_per_row`` -- which both its sync path
  (``_get_nans_in_logits``) and its async path (the counts left on the device) call --
  sums vLLM's per-row counts over the rows vLLM laid out for the step: ``1 +
  len(drafts)`` per request, in the input batch's order (``_prepare_inputs``). Should
  the logits not match that layout, every request is given the whole step's count:
  the safe side.
* **V2** (``vllm.v1.worker.gpu.model_runner``, and 0.34's standalone CPU runner
  ``vllm.v1.worker.cpu.standalone_model_runner``, a V2 runner of its own): ``sample``'s
  per-row counts (the rejection sampler's) are summed with the batch's
  ``cu_num_logits``. With the sampler sharded across ranks vLLM's gather already sums
  per request and is left alone.

Neither adds a host synchronisation: the row layout goes to the device the way vLLM
copies its own (``async_tensor_h2d``), and the sums are device-side gathers
(:func:`kvguard.kernels.sum_rows_per_request`).

V1's sync path (``_get_nans_in_logits``, which reads the counts back) first asks
whether the step's logits hold any NaN at all, with one sum read back in place of
vLLM's counts: a NaN anywhere makes the sum NaN. A clean step -- every step but a
faulty one -- reports 0 for every request of the batch, exactly what vLLM's count
reports, without its ``isnan`` over every logit and its row-by-row dict (on
``benchmarks/vllm_engine.py``'s tiny model on 2 CPU cores: 17-22 us a step instead of
70-86, of a ~4.2 ms step; it was most of what the guard cost there). A NaN sum (a NaN,
or an inf meeting a -inf) takes vLLM's exact count.

The runners are patched when their module is imported (workers import them after
loading plugins), or at once if it already was. Idempotent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from kvguard.adapters.vllm.workers.runner_hooks import RunnerPatches, mark_wrapper

V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
V2_RUNNER = "vllm.v1.worker.gpu.model_runner"
CPU_RUNNER = "vllm.v1.worker.cpu.standalone_model_runner"
"""vLLM 0.34's standalone CPU runner (``StandaloneCPUModelRunner``: CPUs without Triton,
or a platform that asks for it): a Model Runner V2 of its own, not a subclass of the V2
GPU runner (0.34's CPU runner with Triton is one, patched as such), with V2's
``update_requests`` and ``sample``."""
_MARK = "_kvguard_per_request_nans"


# The row layout of the step V1 is booking (None outside _bookkeeping_sync, or for a
# step without drafts). Per thread: a runner books one step at a time.
_booking = threading.local()


def install() -> None:
    """Make vLLM's model runners count NaN logits per request (see the module doc)."""
    PATCHES.install()


def installed() -> bool:
    """Whether :func:`install` ran in this process."""
    return PATCHES.applied


def v1_row_layout(
    req_id_to_index: Mapping[str, int],
    num_reqs: int,
    scheduled_spec_decode_tokens: Mapping[str, Sequence[int]],
    num_rows: int,
) -> list[int] | None:
    """``cu_rows`` of the logits V1 computes for a step: request ``i`` (input batch
    order) owns ``1 + len(drafts)`` rows. None when ``num_rows`` does not match that
    layout (then no row can be told apart: the caller counts the whole step)."""
    rows = [1] * num_reqs
    for req_id, drafts in scheduled_spec_decode_tokens.items():
        index = req_id_to_index.get(req_id)
        if index is None or index >= num_reqs:
            return None
        rows[index] += len(drafts)
    cu_rows = [0]
    for n in rows:
        cu_rows.append(cu_rows[-1] + n)
    return cu_rows if cu_rows[-1] == num_rows else None


def _patch_v1(module: ModuleType) -> None:
    runner = module.GPUModelRunner
    if getattr(runner._bookkeeping_sync, _MARK, False):
        return
    import torch

    from kvguard.kernels import sum_rows_per_request

    stock_count = module.count_nans_per_row
    stock_bookkeeping = runner._bookkeeping_sync
    stock_get_nans = runner._get_nans_in_logits
    to_device = module.async_tensor_h2d
    sync_allowed = module.gpu_sync_allowed

    def count_nans_per_row(logits: torch.Tensor) -> torch.Tensor:
        layout = getattr(_booking, "layout", None)
        per_row: torch.Tensor = stock_count(logits)
        if layout is None:
            return per_row
        cu_rows, num_reqs = layout
        if cu_rows is None:  # unknown layout: every request gets the step's count
            return per_row.sum(dtype=torch.int32).repeat(num_reqs)
        return sum_rows_per_request(per_row, cu_rows)

    def _bookkeeping_sync(
        self: Any, scheduler_output: Any, sampler_output: Any, logits: Any, *args: Any, **kw: Any
    ) -> Any:
        drafts = scheduler_output.scheduled_spec_decode_tokens
        if logits is None or not drafts:
            return stock_bookkeeping(self, scheduler_output, sampler_output, logits, *args, **kw)
        batch = self.input_batch
        cu = v1_row_layout(batch.req_id_to_index, batch.num_reqs, drafts, logits.shape[0])
        cu_rows = None if cu is None else to_device(cu, device=logits.device, dtype=torch.int64)
        _booking.layout = (cu_rows, batch.num_reqs)
        try:
            return stock_bookkeeping(self, scheduler_output, sampler_output, logits, *args, **kw)
        finally:
            _booking.layout = None

    def _get_nans_in_logits(self: Any, logits: Any) -> dict[str, int]:
        if logits is not None:
            # IEEE: NaN + x is NaN, so a sum that is not NaN means no logit is NaN
            # and every request's count is 0 (drafts or not). vLLM reads its counts
            # back here too: one read-back for another, the same sync.
            with sync_allowed():
                total = logits.sum().item()
            if total == total:
                return dict.fromkeys(self.input_batch.req_id_to_index, 0)
        return stock_get_nans(self, logits)  # a NaN, or inf + -inf: count each row

    _mark(count_nans_per_row, stock_count)
    _mark(_bookkeeping_sync, stock_bookkeeping)
    _mark(_get_nans_in_logits, stock_get_nans)
    setattr(module, "count_nans_per_row", count_nans_per_row)  # noqa: B010 (untyped module)
    runner._bookkeeping_sync = _bookkeeping_sync
    runner._get_nans_in_logits = _get_nans_in_logits


def _patch_v2(runner_class: str) -> Callable[[ModuleType], None]:
    """The patch of a V2 runner (the GPU one, 0.34's standalone CPU one): ``sample``'s per-row
    counts summed per request with the batch's ``cu_num_logits`` when a request owns
    several rows. (The CPU runner lays out one row per request -- it has no drafts --
    and keeps vLLM's counts; the patch stands should it grow them.)"""

    def patch(module: ModuleType) -> None:
        runner = getattr(module, runner_class)
        if getattr(runner.sample, _MARK, False):
            return
        from kvguard.kernels import sum_rows_per_request

        stock_sample = runner.sample

        def sample(self: Any, hidden_states: Any, input_batch: Any, *args: Any, **kw: Any) -> Any:
            result = stock_sample(self, hidden_states, input_batch, *args, **kw)
            sampler_output = result[0]
            per_row = sampler_output.num_nans
            drafts: int = getattr(input_batch, "num_draft_tokens", 0)  # (none on CPU)
            if (
                per_row is not None
                # sharded: vLLM's gather sums per request
                and getattr(self, "batch_sharder", None) is None
                and (drafts or per_row.shape[0] != input_batch.num_reqs)
            ):
                sampler_output.num_nans = sum_rows_per_request(per_row, input_batch.cu_num_logits)
            return result

        _mark(sample, stock_sample)
        runner.sample = sample

    return patch


def _mark(patched: Any, stock: Any) -> None:
    """Tell the patch from vLLM's function (idempotence) and keep the way back."""
    mark_wrapper(patched, stock, _MARK)


PATCHES = RunnerPatches(
    {
        V1_RUNNER: _patch_v1,
        V2_RUNNER: _patch_v2("GPUModelRunner"),
        CPU_RUNNER: _patch_v2("StandaloneCPUModelRunner"),
    }
)
