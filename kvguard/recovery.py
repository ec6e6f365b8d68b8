"""Fault recovery: roll a request back to its surviving KV (``zero_request_tail``), or
an engine's own block tables back to theirs (``roll_back_blocks``); and what that saves
(:func:`recompute_after_lost_steps`).

The pool plans the rollback and queues the token slots to wipe (sans-IO); the kernels
layer (:class:`kvguard.kernels.CacheWiper`) executes the wipe on the device.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from kvguard import arguments
from kvguard.errors import PoolMisuseError, RollbackError
from kvguard.pool_core import PoolCore, _cdiv
from kvguard.results import SlotRange, TailRollback
from kvguard.states import MATCHABLE_STATES, BlockState


@dataclass(frozen=True, slots=True)
class RecomputeCost:
    """Tokens one request recomputes after its steps in flight are lost, by approach
    (:func:`recompute_after_lost_steps`)."""

    rollback: int
    """Rolled back to its validated boundary (kvguard: ``zero_request_tail``, or
    ``recover()`` in vLLM): the tokens its lost steps computed, no more."""
    drop_blocks: int
    """The blocks its lost steps touched dropped and the request preempted (vLLM PR
    #50265), or the request aborted and resubmitted: every token it had computed but
    those of its published full blocks below the lost steps (its prefix-cache hits)."""


def recompute_after_lost_steps(
    computed: int, in_flight: int, block_size: int, published_blocks: int
) -> RecomputeCost:
    """What a request whose steps in flight are lost (a rank failed) recomputes.

    ``computed``: its computed tokens at the fault, the lost steps' included (vLLM's
    ``num_computed_tokens``; the pool's written tokens); ``in_flight``: the tokens the
    lost steps compute; ``published_blocks``: how many of its blocks, counted from its
    first, are published (a prefix lookup finds them)::

        0              kept     boundary                computed
        |== published ==|- - - - -|####### in flight #######|
                        |<------------- drop_blocks ------->|
                                  |<------ rollback ------->|

    ``boundary = computed - in_flight`` and ``kept = min(published_blocks, boundary //
    block_size) * block_size``. A rollback keeps everything below the boundary, a
    partial block's validated prefix included. Dropping the touched blocks and
    preempting, like aborting and resubmitting, frees the request's blocks: only the
    published full ones below the first touched block are found again, and validated
    KV that was not published (a partial block, caching off) is recomputed too. Pure
    arithmetic (no pool), so that a simulator, an engine adapter and a test compare
    the approaches by one rule.
    """
    computed = arguments.count("computed", computed)
    in_flight = arguments.count("in_flight", in_flight)
    block_size = arguments.count("block_size", block_size)
    published_blocks = arguments.count("published_blocks", published_blocks)
    if block_size == 0:
        raise PoolMisuseError("block_size must be at least 1, got 0")
    if in_flight > computed:
        raise PoolMisuseError(
            f"in_flight ({in_flight}) exceeds computed ({computed}): the lost steps' tokens "
            "are part of the computed ones"
        )
    boundary = computed - in_flight
    kept = min(published_blocks, boundary // block_size) * block_size
    return RecomputeCost(rollback=in_flight, drop_blocks=computed - kept)


class Recovery:
    """Rolling a request back to its validated boundary (``zero_request_tail``)."""

    __slots__ = ("_block_size", "_core", "_kernel")

    _ROLLABLE = (BlockState.WRITTEN, BlockState.VALIDATED)

    def __init__(self, core: PoolCore) -> None:
        self._core = core
        self._kernel = core.kernel
        self._block_size = core.block_size

    def zero_request_tail(self, request_id: str, num_tokens: int | None = None) -> TailRollback:
        """Roll the request back so it can resume from its surviving KV.

        By default everything past the validated boundary is dropped; ``num_tokens``
        drops exactly the last ``num_tokens`` written tokens instead. The dropped token
        slots are queued, at token granularity, for ``take_slots_to_zero`` (a partial
        block keeps its valid prefix). The request's in-flight steps past the new
        boundary are forgotten: their results must not be delivered. A request aborted
        by a failed step is revived. Published (shared) blocks are never rolled back.

        Token ids past the boundary that the request generated are dropped (it will
        generate them again); a request opened with caller-supplied ``block_hashes``
        keeps its hash list, so its caller must not resume with different tokens.
        """
        rec = self._core.record(request_id)
        old = rec.num_written
        if num_tokens is None:
            boundary = rec.num_validated
        else:
            num_tokens = arguments.count("num_tokens", num_tokens)
            if num_tokens > old:
                raise PoolMisuseError(
                    f"cannot roll back {num_tokens} tokens: request {request_id!r} has "
                    f"written only {old}; pass at most {old}, or None for everything past "
                    "its validated boundary"
                )
            boundary = old - num_tokens
            if rec.aborted and boundary > rec.num_validated:
                raise RollbackError(
                    f"request {request_id!r} was aborted: tokens past its validated boundary "
                    f"({rec.num_validated}) come from a failed step or were computed on "
                    f"invalidated KV, and cannot be kept: zero_request_tail({request_id!r}) "
                    "rolls it back to that boundary"
                )
        size = self._block_size
        kernel = self._kernel
        blocks = kernel.blocks
        table = rec.blocks
        affected = range(boundary // size, _cdiv(old, size) if boundary < old else 0)
        for i in affected:
            block = blocks[table[i]]
            if block.state in MATCHABLE_STATES or block.ref_cnt != 1 or block.external_refs:
                raise RollbackError(
                    f"rolling request {request_id!r} back to token {boundary} would wipe "
                    f"block {block.block_id} ({block.state.name}, ref_cnt={block.ref_cnt}), "
                    "which other requests can see; invalidate() its hash instead"
                )
        new_validated = min(rec.num_validated, boundary)
        slots: list[SlotRange] = []
        for i in affected:
            block = blocks[table[i]]
            lo = max(boundary, i * size) - i * size
            hi = min(old, (i + 1) * size) - i * size
            # The ledger is replayed for the tokens this block keeps (its first lo).
            slots.append(kernel.rollback(block.block_id, lo, hi, i * size + lo <= new_validated))
        kept = deque(end for end in rec.pending if end < boundary)
        if boundary > (kept[-1] if kept else new_validated):
            kept.append(boundary)  # the step that straddled the boundary, truncated
        rec.pending = kept
        rec.discarded.clear()
        rec.aborted = False
        rec.num_written = boundary
        rec.num_validated = new_validated
        rec.publish_cursor = min(rec.publish_cursor, new_validated // size)
        # The token at position t was sampled by the step that processed t - 1, so the
        # ids up to and including ``boundary`` stay valid; later generated ones will be
        # produced again. Prompt ids always stay.
        if boundary < old:  # (a rollback of nothing drops no token id)
            del rec.token_ids[max(boundary + 1, rec.num_prompt_tokens) :]
            if not rec.explicit_hashes:
                del rec.block_hashes[len(rec.token_ids) // size :]
        kernel.counters.slots_zeroed += old - boundary
        return TailRollback(request_id, boundary, old - boundary, tuple(slots))

    def roll_back_blocks(self, tails: Mapping[int, int]) -> tuple[SlotRange, ...]:
        """Roll block-level-held blocks back to the tokens they keep: ``{block_id:
        keep}``, ``0 <= keep < block_size``.

        For an engine with its own block tables (the vLLM adapter) whose request
        resumes from its validated KV after a fault: each block's token slots from
        ``keep`` to its end are queued for ``take_slots_to_zero`` (a partial block keeps
        its valid prefix), and the block is WRITTEN again by one step -- its holder's
        next step rewrites and validates it. Its hash and any deferred publication are
        void, and its generation moves on (a tier copy begun before is dropped).

        Only a block its one block-level holder alone sees (WRITTEN or VALIDATED,
        one reference) can be rolled back; one others can match or hold raises
        :class:`RollbackError` and nothing changes. Returns the queued slot ranges.
        """
        if not isinstance(tails, Mapping):
            raise PoolMisuseError(
                f"roll_back_blocks() takes a mapping {{block_id: tokens kept}}, got "
                f"{arguments.got(tails)}"
            )
        size = self._block_size
        kernel = self._kernel
        planned: list[tuple[int, int]] = []
        for raw_id, raw_keep in tails.items():
            block = self._core.block(raw_id)  # raises UnknownBlockError
            keep = arguments.count("tokens kept", raw_keep)
            if keep >= size:
                raise PoolMisuseError(
                    f"block {block.block_id} keeps {keep} tokens: a rollback keeps fewer "
                    f"than the block's {size}; leave a block that keeps all out"
                )
            kernel.check_block_level(block.block_id)
            if block.state not in self._ROLLABLE or block.ref_cnt != 1:
                raise RollbackError(
                    f"block {block.block_id} ({block.state.name}, ref_cnt={block.ref_cnt}) "
                    "cannot be rolled back: only a WRITTEN or VALIDATED block its one "
                    "holder alone sees can be; invalidate() a published block's hash instead"
                )
            planned.append((block.block_id, keep))
        if len({block_id for block_id, _ in planned}) != len(planned):
            raise PoolMisuseError("roll_back_blocks() names a block twice")
        return tuple(kernel.rollback_held(block_id, keep, size) for block_id, keep in planned)
