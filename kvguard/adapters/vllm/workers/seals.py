"""Seals in vLLM's workers: a fingerprint of each block a step filled, taken after the
forward and reported with the step's NaN counts.

With seals on (``{"kvguard": {"seal": true}}``) the guarded scheduler sends, with each
step, the blocks the step fills -- those it publishes once the step validates -- as
``SchedulerOutput.kvguard_blocks_to_seal`` (request id -> block ids). After the
forward, the worker seals them, and only them: one
:func:`~kvguard.kernels.seal_blocks` launch per cache geometry over every layer (its
torch path on CPU), the geometries' seals summed (each under its own salt) into one
seal per block. The seals ride on the step's per-request NaN counts, read back on the
host already (:class:`~kvguard.adapters.vllm.workers.audit.AuditedCounts`, whose
``seals`` maps block id -> seal); the scheduler records each with its block when the
step validates (``GuardedBlockPool.validate_fills(ids, seals)``), and every copy of
the block then carries it.

Where the counts are read back on the host -- V1's synchronous path
(``_bookkeeping_sync``: 0.32, 0.33, vLLM's CPU build) and 0.34's standalone CPU runner
(``sample_tokens``) -- and nowhere else: under asynchronous scheduling and on V2's GPU
runner the counts stay on the device, and reading seals there would add a host
synchronisation to every step. The scheduler refuses seals where they cannot be taken
(docs/vllm-reference.md, "Seals").

The salt binds a seal to the instance's cache: the model, the KV dtype and each
geometry's shape and layout (:func:`runner_salt`). A copy written by another model,
dtype, block size or layout never verifies here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Container, Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any

from kvguard.adapters.vllm.workers.audit import AuditedCounts, with_seals
from kvguard.adapters.vllm.workers.caches import block_layouts
from kvguard.adapters.vllm.workers.nans import CPU_RUNNER, V1_RUNNER
from kvguard.adapters.vllm.workers.runner_hooks import RunnerPatches, mark_wrapper

SEAL_FIELD = "kvguard_blocks_to_seal"
"""The ``SchedulerOutput`` attribute with the blocks to seal (request id -> block ids)."""

_MARK = "_kvguard_seals_kv"


_process_runner: list[Any] = []
"""The model runner of this worker process, once the guard checked it seals
(:func:`runner_seals`): what a connector's worker side seals loaded KV with."""


def process_runner() -> Any | None:
    """This worker process's sealing model runner, or None (seals off, or not a worker)."""
    return _process_runner[0] if _process_runner else None


def runner_salt(runner: Any) -> list[int]:
    """One salt per block layout of ``runner`` (:func:`block_layouts`, in order): a hash
    of the model, and of the layout's kind, dtype, shape and strides, and of its place
    among the layouts. Cached on the runner."""
    salts = getattr(runner, "_kvguard_seal_salts", None)
    if salts is None:
        model = str(getattr(getattr(runner, "model_config", None), "model", ""))
        salts = []
        for index, layout in enumerate(block_layouts(runner)):
            cache = layout.caches[0]
            tag = repr(
                (
                    model,
                    index,
                    layout.kind.name,
                    str(layout.dtype),
                    layout.num_layers,
                    tuple(cache.shape),
                    tuple(cache.stride()),
                )
            )
            digest = hashlib.blake2b(tag.encode(), digest_size=8).digest()
            salts.append(int.from_bytes(digest, "little", signed=True))
        runner._kvguard_seal_salts = salts
    return salts


def seal_step(runner: Any, blocks: Mapping[str, Sequence[int]]) -> dict[int, int]:
    """The seal of every block of ``blocks`` (request id -> block ids): block id ->
    seal, summed over the runner's cache geometries (read back on the host)."""
    from kvguard.kernels import seal_blocks

    ids = list(dict.fromkeys(b for block_ids in blocks.values() for b in block_ids))
    if not ids:
        return {}
    total = None
    for layout, salt in zip(block_layouts(runner), runner_salt(runner), strict=True):
        seals = seal_blocks(layout, ids, salt=salt)
        total = seals if total is None else total + seals  # (int64: wraps, mod 2**64)
    if total is None:  # no attention cache: nothing to seal
        return {}
    return dict(zip(ids, total.tolist(), strict=True))


def unsealed_blocks(expected: Mapping[int, int | None]) -> list[int]:
    """The blocks of ``expected`` (block id -> the seal its copy carries) whose KV, as
    loaded into this worker's cache, does not give that seal: every one of them when
    this process has no sealing runner (a load that cannot be verified is refused).
    The one check every sealed exit's worker side makes on a load."""
    if not expected:
        return []
    runner = process_runner()
    if runner is None:
        return list(expected)
    got = seal_step(runner, {"": list(expected)})
    return [block_id for block_id, seal in expected.items() if got.get(block_id) != seal]


class LoadVerifier:
    """A connector worker side's sealed loads until each completes: the seal each block
    it fills must give (load key -> block id -> seal; the key is the connector's: a
    load job, a load event, a request), and the blocks refused since the last report
    (what ``get_block_ids_with_load_errors`` adds). Every sealed exit's worker side
    keeps one."""

    def __init__(self) -> None:
        self.expected: dict[Any, dict[int, int | None]] = {}
        self._refused: set[int] = set()

    def expect(self, sealed: Mapping[Any, dict[int, int | None]] | None) -> None:
        """The loads a step's connector metadata sends (its ``LOAD_SEALS``, if any)."""
        if sealed:
            self.expected.update(sealed)

    def verify(self, done: Iterable[Any], skip: Container[Any] = ()) -> dict[Any, list[int]]:
        """Each expected load of ``done`` completed: seal what it filled
        (:func:`unsealed_blocks`) and refuse the blocks that differ; one in ``skip``
        (its transfer failed: vLLM's to handle) is dropped unverified. Returns the
        loads with refused blocks, and those blocks."""
        refused: dict[Any, list[int]] = {}
        for key in [k for k in done if k in self.expected]:
            seals = self.expected.pop(key)
            if key in skip:
                continue
            bad = unsealed_blocks(seals)
            if bad:
                refused[key] = bad
                self._refused.update(bad)
        return refused

    def take_refused(self) -> set[int]:
        """The blocks refused since the last call."""
        refused, self._refused = self._refused, set()
        return refused


def _patch_v1(module: ModuleType) -> None:
    runner = module.GPUModelRunner
    stock = runner._bookkeeping_sync
    if getattr(stock, _MARK, False):
        return

    def _bookkeeping_sync(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        result = stock(self, scheduler_output, *args, **kwargs)
        blocks = getattr(scheduler_output, SEAL_FIELD, None)
        if not blocks:
            return result
        counts, device_counts, *rest = result
        if device_counts is not None or counts is None:
            return result  # async scheduling: refused at start-up (no host read here)
        return (with_seals(counts, seal_step(self, blocks)), device_counts, *rest)

    runner._bookkeeping_sync = mark_wrapper(_bookkeeping_sync, stock, _MARK)


def _patch_cpu(module: ModuleType) -> None:
    """0.34's standalone CPU runner: its counts are read back in ``sample_tokens``."""
    runner = module.StandaloneCPUModelRunner
    stock_update = runner.update_requests
    stock = runner.sample_tokens
    if getattr(stock, _MARK, False):
        return

    def update_requests(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        self._kvguard_seal = getattr(scheduler_output, SEAL_FIELD, None)
        return stock_update(self, scheduler_output, *args, **kwargs)

    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = stock(self, *args, **kwargs)
        blocks = getattr(self, "_kvguard_seal", None)
        counts = getattr(output, "num_nans_in_logits", None)
        if blocks and counts is not None:
            self._kvguard_seal = None
            output.num_nans_in_logits = with_seals(counts, seal_step(self, blocks))
        return output

    runner.update_requests = mark_wrapper(update_requests, stock_update, _MARK)
    runner.sample_tokens = mark_wrapper(sample_tokens, stock, _MARK)


PATCHES = RunnerPatches({V1_RUNNER: _patch_v1, CPU_RUNNER: _patch_cpu})


def install() -> None:
    """Make vLLM's model runners seal ``kvguard_blocks_to_seal`` (see the module doc): at
    once for a runner module already imported, else when it is. Idempotent."""
    PATCHES.install()


def installed() -> bool:
    """Whether :func:`install` ran in this process."""
    return PATCHES.applied


def runner_seals(runner: Any) -> bool:
    """Whether ``runner`` applies ``kvguard_blocks_to_seal``: its class has the patch and
    kvguard knows the layout of every one of its attention caches."""
    from kvguard.adapters.vllm.pool.block_pool import GuardModeUnsupported

    method = "_bookkeeping_sync" if hasattr(type(runner), "_bookkeeping_sync") else "sample_tokens"
    if not getattr(getattr(type(runner), method, None), _MARK, False):
        return False
    try:
        block_layouts(runner)
    except GuardModeUnsupported:
        return False
    _process_runner[:] = [runner]
    return True


__all__ = [
    "SEAL_FIELD",
    "AuditedCounts",
    "LoadVerifier",
    "install",
    "runner_seals",
    "seal_step",
    "unsealed_blocks",
]
