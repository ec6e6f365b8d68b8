"""Sealed prefill/decode handoffs: a request's KV handed to another instance over NIXL
carries its blocks' seals, and the receiving instance verifies what it read.

A prefill instance hands a request's blocks over when the request finishes
(``request_finished``: vLLM's ``NixlConnector`` returns the transfer parameters the
client forwards to the decode instance: ``remote_block_ids`` and where to read them).
With seals on (``{"kvguard": {"seal": true}}``):

* **The prefill side** adds the seal of each block it hands over, as kvguard recorded
  it when the block's step validated: ``kv_transfer_params["kvguard_seals"]``, lists
  parallel to ``remote_block_ids`` (None for a block with no seal: the last, partial
  block). The request-finished gate (:func:`.gate.withhold_from_connector`) hands over
  only requests that ended after clean, counted steps; these are their seals.
* **The decode side** sends its workers, with each read it schedules, the seal each
  local block must give (:data:`.gate.LOAD_SEALS` on the NIXL metadata: request id ->
  local block -> seal; vLLM pairs a read's local and remote blocks from the end, and so
  does this). When a worker's read completes it seals the blocks it read
  (:func:`kvguard.adapters.vllm.workers.seals.unsealed_blocks`) and reports those that
  differ as blocks that failed to load: vLLM's ``kv_load_failure_policy`` recomputes the
  request from the first of them, or fails it. A read whose parameters carry no seals
  (a prefill instance without seals) is refused as a whole: the decode instance then
  computes the prompt itself. Blocks the prefill side holds no seal for are not verified.

The workers' side is a patch of vLLM's ``NixlConnector`` (pull mode, the default),
installed with the other worker patches; it acts only on reads that carry seals.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any

from vllm.logger import init_logger

from kvguard.adapters.vllm.exits.gate import LOAD_SEALS
from kvguard.adapters.vllm.workers.runner_hooks import RunnerPatches, mark_wrapper
from kvguard.adapters.vllm.workers.seals import LoadVerifier

logger = init_logger(f"vllm.{__name__}")
"""Under vLLM's logger, as the scheduler's: vLLM's handler, format and level apply."""

HANDOFF_SEALS = "kvguard_seals"
"""The transfer parameter with the seals of the blocks handed over (per group, parallel
to ``remote_block_ids``)."""

NIXL_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector"

_MARK = "_kvguard_verifies_handoffs"
_LOADS = "_kvguard_loads"
"""Where a patched connector keeps its :class:`LoadVerifier` (its ``__dict__``)."""


# ---------------------------------------------------------------------- scheduler side


def seal_handoff(params: dict[str, Any] | None, block_seal: Any) -> None:
    """Add to a finished request's transfer parameters the seal of each block it hands
    over (``block_seal``: block id -> its seal or None, the pool's)."""
    if not params or not params.get("remote_block_ids"):
        return
    params[HANDOFF_SEALS] = [[block_seal(b) for b in group] for group in params["remote_block_ids"]]


def expect_handoff_seals(meta: Any, requests: Mapping[str, Any]) -> dict[str, set[int]]:
    """On the NIXL metadata a step sends its workers (inside a MultiConnector's, too):
    the seal each local block of each read must give. A read whose parameters carry no
    seals expects None for each block (refused). Returns each read's local blocks."""
    covered: dict[str, set[int]] = {}
    for child in getattr(meta, "metadata", None) or (meta,):
        reads = getattr(child, "reqs_to_recv", None)
        if not reads:
            continue
        expected: dict[str, dict[int, int | None]] = {}
        for req_id, read in reads.items():
            request = requests.get(req_id)
            params = getattr(request, "kv_transfer_params", None) or {}
            expected[req_id] = _paired(read.local_block_ids, params.get(HANDOFF_SEALS))
        setattr(child, LOAD_SEALS, expected)
        covered.update(
            (r, {b for group in reads[r].local_block_ids for b in group}) for r in expected
        )
    return covered


def _paired(
    local: Sequence[Sequence[int]], seals: Sequence[Sequence[int | None]] | None
) -> dict[int, int | None]:
    """Local block -> the seal it must give: paired from the end, per group, as vLLM's
    NIXL worker pairs local and remote blocks. Without seals, None for every block; a
    block paired with None (the prefill side holds no seal) is left out (unverified)."""
    out: dict[int, int | None] = {}
    for g, group in enumerate(local):
        group_seals = seals[g] if seals is not None and g < len(seals) else None
        if group_seals is None:
            out.update(dict.fromkeys(group))
            continue
        pairs = min(len(group), len(group_seals))
        paired = zip(
            group[len(group) - pairs :], group_seals[len(group_seals) - pairs :], strict=True
        )
        for block_id, seal in paired:
            if seal is not None:
                out[block_id] = seal
        out.update(dict.fromkeys(group[: len(group) - pairs]))  # (nothing to pair: refused)
    return out


VERIFIED_CONNECTORS = frozenset({"NixlConnector", "NixlPullConnector"})
"""The connectors whose reads of handed-over KV the workers verify (the patched class
and its name in vLLM 0.34)."""


def reads_handoffs(kv_transfer_config: Any) -> bool:
    """Whether an engine with this transfer config reads KV a prefill instance handed
    over through a verified connector (directly or inside a MultiConnector)."""
    if kv_transfer_config is None:
        return False
    names = [kv_transfer_config.kv_connector]
    extra = kv_transfer_config.kv_connector_extra_config or {}
    names += [c.get("kv_connector") for c in extra.get("connectors", ()) if isinstance(c, dict)]
    return not VERIFIED_CONNECTORS.isdisjoint(names)


# ---------------------------------------------------------------------- worker side


def _patch_nixl(module: ModuleType) -> None:
    """vLLM's ``NixlConnector`` verifies each sealed read when it completes."""
    cls = module.NixlConnector
    stock_bind = cls.bind_connector_metadata
    if getattr(stock_bind, _MARK, False):
        return
    results = "get_transfer_results" if "get_transfer_results" in _own(cls) else "get_finished"
    stock_results = getattr(cls, results)
    stock_errors = cls.get_block_ids_with_load_errors

    def bind_connector_metadata(self: Any, connector_metadata: Any) -> None:
        stock_bind(self, connector_metadata)
        sealed = getattr(connector_metadata, LOAD_SEALS, None)
        if sealed:
            _loads(self).expect(sealed)

    def finished(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = stock_results(self, *args, **kwargs)
        loads = self.__dict__.get(_LOADS)
        if loads is not None and loads.expected:
            received = (out.finished_recving if results == "get_transfer_results" else out[1]) or ()
            for req_id, bad in loads.verify(received).items():
                logger.warning(
                    "kvguard: request %s: %d block(s) it read from its prefill instance do "
                    "not verify by their seals (the KV is not what validated there, or the "
                    "handoff carried none); the load fails -- vLLM's kv_load_failure_policy "
                    "decides whether the request recomputes or fails",
                    req_id,
                    len(bad),
                )
        return out

    def get_block_ids_with_load_errors(self: Any) -> set[int]:
        loads = self.__dict__.get(_LOADS)
        refused = loads.take_refused() if loads is not None else set()
        return set(stock_errors(self)) | refused

    cls.bind_connector_metadata = mark_wrapper(bind_connector_metadata, stock_bind, _MARK)
    setattr(cls, results, mark_wrapper(finished, stock_results, _MARK))
    cls.get_block_ids_with_load_errors = mark_wrapper(
        get_block_ids_with_load_errors, stock_errors, _MARK
    )


def _own(cls: type) -> Iterable[str]:
    """The attributes ``cls`` or a base below vLLM's connector base defines."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__name__ == "KVConnectorBase_V1":
            break
        names.update(vars(klass))
    return names


def _loads(connector: Any) -> LoadVerifier:
    """The connector's sealed reads (by request id), made at its first."""
    loads: LoadVerifier = connector.__dict__.setdefault(_LOADS, LoadVerifier())
    return loads


PATCHES = RunnerPatches({NIXL_MODULE: _patch_nixl})


def install() -> None:
    """Make vLLM's NIXL connector verify sealed reads (see the module doc): at once if
    its module is imported, else when it is. Idempotent."""
    PATCHES.install()
