"""The KV audit in vLLM's workers: finite logits do not prove finite KV.

A NaN written into a layer's KV after attention read it, or into a slot no query has
attended yet, leaves the step's logits finite; published, the block would poison every
request that hits it. With the audit on (``{"kvguard": {"audit": true}}``) the guarded
scheduler sends, with each step, the blocks the step fills -- those it would publish
once the step validates -- as ``SchedulerOutput.kvguard_blocks_to_audit`` (request id
-> block ids). After the forward, the worker scans them, and only them, for NaN and
infinities: one :func:`~kvguard.kernels.audit_blocks` launch per cache geometry over
every layer (its torch reference on CPU), flags summed per request on the device.
Each request's flagged blocks are added to its NaN count, so a request whose filled
blocks hold a non-finite value fails the step as for NaN logits (aborted, its blocks
quarantined) through the one path the scheduler already has:

* **V1** (``vllm.v1.worker.gpu_model_runner``: 0.32, 0.33, vLLM's CPU build): in
  ``_bookkeeping_sync``, which takes the counts. Synchronous scheduling reads them
  back there already: the counts of a step with blocks to audit come back as
  :class:`AuditedCounts`, which also say how many blocks of each request the audit
  flagged (the scheduler's log names the cause). Asynchronous scheduling keeps the
  counts on the device: the flags are added there (no host synchronisation; the log
  then says "NaN logits or KV").
* **V2** (``vllm.v1.worker.gpu.model_runner``, and 0.34's standalone CPU runner
  ``vllm.v1.worker.cpu.standalone_model_runner``): ``update_requests`` keeps the step's
  blocks, ``sample`` adds the flags to the sampler's per-request counts on the device.
  The CPU runner reads its counts back at once: they come back as
  :class:`AuditedCounts`, as under V1's synchronous path.

Which layout each layer's cache has, and how a scheduler block maps onto its kernel
blocks, is :func:`~kvguard.adapters.vllm.workers.caches.block_layouts`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from kvguard.adapters.vllm.workers.caches import block_layouts
from kvguard.adapters.vllm.workers.nans import CPU_RUNNER, V1_RUNNER, V2_RUNNER
from kvguard.adapters.vllm.workers.runner_hooks import RunnerPatches, mark_wrapper

AUDIT_FIELD = "kvguard_blocks_to_audit"
"""The ``SchedulerOutput`` attribute with the blocks to audit (request id -> block ids)."""

_MARK = "_kvguard_audits_kv"


class AuditedCounts(dict[str, int]):
    """Per-request NaN counts with what the worker found besides: ``kv_audit`` maps each
    request the KV audit flagged to its blocks holding NaN or an infinity (added to its
    count), ``seals`` each block the step filled to its seal
    (:mod:`kvguard.adapters.vllm.workers.seals`)."""

    kv_audit: dict[str, int]
    seals: dict[int, int]

    def __init__(self, counts: Mapping[str, int], kv_audit: dict[str, int]) -> None:
        super().__init__(counts)
        self.kv_audit = kv_audit
        self.seals = {}
        for req_id, flagged in kv_audit.items():
            self[req_id] = self.get(req_id, 0) + flagged

    def __reduce__(self) -> Any:  # (dict's own pickling would drop the attributes)
        return _restore, (dict(self), self.kv_audit, self.seals)


def _restore(
    counts: dict[str, int], kv_audit: dict[str, int], seals: dict[int, int] | None = None
) -> AuditedCounts:
    """An :class:`AuditedCounts` from its counts with the findings already added."""
    restored = AuditedCounts(counts, {})
    restored.kv_audit = kv_audit
    restored.seals = seals or {}
    return restored


def with_seals(counts: Mapping[str, int], seals: dict[int, int]) -> AuditedCounts:
    """``counts`` (plain, or with the audit's findings) carrying ``seals`` too."""
    if isinstance(counts, AuditedCounts):
        out = _restore(dict(counts), counts.kv_audit, seals)
    else:
        out = _restore(dict(counts), {}, seals)
    return out


def audit_requests(runner: Any, blocks: Mapping[str, Sequence[int]]) -> Any:
    """Blocks holding NaN or an infinity in any layer, per request of ``blocks`` (in
    its order): int32 ``[len(blocks)]`` on the caches' device, no host synchronisation."""
    import torch

    from kvguard.kernels import audit_blocks, sum_rows_per_request

    ids: list[int] = []
    cu = [0]
    for block_ids in blocks.values():
        ids += block_ids
        cu.append(len(ids))
    flags = None
    for layout in block_layouts(runner):
        found = audit_blocks(layout, ids)
        flags = found if flags is None else flags | found
    if flags is None:  # no attention cache: nothing to audit
        return torch.zeros(len(blocks), dtype=torch.int32)
    if flags.device.type == "cpu" and not bool(flags.any()):
        # (A clean step on CPU, where reading the flags costs nothing: no sums.)
        return torch.zeros(len(blocks), dtype=torch.int32)
    per_block = flags.to(torch.int32)
    return sum_rows_per_request(per_block, torch.tensor(cu, device=per_block.device))


def add_to_device_counts(counts: Any, rows: Sequence[int], flagged: Any) -> None:
    """Add ``flagged`` (per audited request) to ``counts`` rows ``rows``, on the device."""
    import torch

    index = torch.tensor(rows, dtype=torch.int64).to(counts.device, non_blocking=True)
    counts.index_add_(0, index, flagged.to(device=counts.device, dtype=counts.dtype))


def _patch_v1(module: ModuleType) -> None:
    runner = module.GPUModelRunner
    stock = runner._bookkeeping_sync
    if getattr(stock, _MARK, False):
        return

    def _bookkeeping_sync(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        result = stock(self, scheduler_output, *args, **kwargs)
        blocks = getattr(scheduler_output, AUDIT_FIELD, None)
        if not blocks:
            return result
        counts, device_counts, *rest = result
        flagged = audit_requests(self, blocks)
        if device_counts is not None:  # async scheduling: the counts stay on the device
            index = self.input_batch.req_id_to_index
            audited = [r for r in blocks if r in index]
            keep = [i for i, r in enumerate(blocks) if r in index]
            add_to_device_counts(device_counts, [index[r] for r in audited], flagged[keep])
            return (counts, device_counts, *rest)
        found = {r: n for r, n in zip(blocks, flagged.tolist(), strict=True) if n}
        return (AuditedCounts(counts, found), device_counts, *rest)

    runner._bookkeeping_sync = mark_wrapper(_bookkeeping_sync, stock, _MARK)


def _patch_v2(runner_class: str) -> Callable[[ModuleType], None]:
    def patch(module: ModuleType) -> None:
        _patch_v2_runner(getattr(module, runner_class))

    return patch


def _patch_v2_runner(runner: Any) -> None:
    stock_update = runner.update_requests
    stock_sample = runner.sample
    if getattr(stock_sample, _MARK, False):
        return

    def update_requests(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        self._kvguard_audit = getattr(scheduler_output, AUDIT_FIELD, None)
        return stock_update(self, scheduler_output, *args, **kwargs)

    def sample(self: Any, hidden_states: Any, input_batch: Any, *args: Any, **kw: Any) -> Any:
        result = stock_sample(self, hidden_states, input_batch, *args, **kw)
        blocks = getattr(self, "_kvguard_audit", None)
        counts = result[0].num_nans
        if blocks and counts is not None:
            self._kvguard_audit = None
            rows = {r: i for i, r in enumerate(input_batch.req_ids)}
            audited = [r for r in blocks if r in rows]
            keep = [i for i, r in enumerate(blocks) if r in rows]
            flagged = audit_requests(self, blocks)[keep]
            add_to_device_counts(counts, [rows[r] for r in audited], flagged)
            if flagged.device.type == "cpu":  # (read on the host for free: see below)
                found = {r: n for r, n in zip(audited, flagged.tolist(), strict=True) if n}
                self._kvguard_found = found
        return result

    runner.update_requests = mark_wrapper(update_requests, stock_update, _MARK)
    runner.sample = mark_wrapper(sample, stock_sample, _MARK)


def _patch_cpu(module: ModuleType) -> None:
    """0.34's standalone CPU runner: V2's patches, and its findings told apart from NaN
    logits. That runner reads the step's counts back in ``sample_tokens``, right after
    ``sample``, on the host: its output's counts become an :class:`AuditedCounts`
    with what ``sample`` found, as V1's synchronous path gives them (the scheduler
    counts ``requests_failed_audit`` and its log names the cause)."""
    runner = module.StandaloneCPUModelRunner
    _patch_v2_runner(runner)
    stock = runner.sample_tokens
    if getattr(stock, _MARK, False):
        return

    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._kvguard_found = None
        output = stock(self, *args, **kwargs)
        found = self._kvguard_found
        counts = getattr(output, "num_nans_in_logits", None)
        if found is not None and counts is not None:
            self._kvguard_found = None
            output.num_nans_in_logits = _restore(counts, found)  # (the flags are in)
        return output

    runner.sample_tokens = mark_wrapper(sample_tokens, stock, _MARK)


PATCHES = RunnerPatches(
    {
        V1_RUNNER: _patch_v1,
        V2_RUNNER: _patch_v2("GPUModelRunner"),
        CPU_RUNNER: _patch_cpu,
    }
)


def install() -> None:
    """Make vLLM's model runners audit ``kvguard_blocks_to_audit`` (see the module
    doc): at once for a runner module already imported, else when it is. Idempotent."""
    PATCHES.install()


def installed() -> bool:
    """Whether :func:`install` ran in this process."""
    return PATCHES.applied


def runner_audits(runner: Any) -> bool:
    """Whether ``runner`` applies ``kvguard_blocks_to_audit``: its class has the patch
    and kvguard knows the layout of every one of its attention caches."""
    from kvguard.adapters.vllm.pool.block_pool import GuardModeUnsupported

    method = "_bookkeeping_sync" if hasattr(type(runner), "_bookkeeping_sync") else "sample"
    if not getattr(getattr(type(runner), method, None), _MARK, False):
        return False
    try:
        block_layouts(runner)
    except GuardModeUnsupported:
        return False
    return True
