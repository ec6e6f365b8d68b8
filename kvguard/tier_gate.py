"""The tier gate: only validated blocks are copied to lower tiers, late acks are dropped,
and hashes found corrupt after the fact are invalidated everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvguard import arguments
from kvguard.block import Block
from kvguard.errors import NotStorableError, UnknownTicketError
from kvguard.events import BlockRemoved, RequestAborted
from kvguard.hashing import BlockHash
from kvguard.pool_core import PoolCore
from kvguard.request_record import RequestRecord
from kvguard.results import InvalidationReport, StoreTicket
from kvguard.states import STORABLE_STATES, BlockState


def storable_as(block: Block, key: BlockHash) -> bool:
    """The storable rule: ``block`` may leave the instance (be copied to a tier, shared,
    sent) as ``key`` -- it is VALIDATED or later and carries ``key``. A block quarantined,
    still being written, or holding other tokens now (reused since) may not. Every exit
    asks this one predicate (:meth:`TierGate.storable_as`; the vLLM adapter's exit gate
    reads its block records through it)."""
    return block.block_hash == key and block.state in STORABLE_STATES


class TierGate:
    """Offload admission after validation, store acknowledgements, taint by hash."""

    __slots__ = ("_block_size", "_core", "_kernel", "_requests", "_tiers")

    def __init__(self, core: PoolCore) -> None:
        self._core = core
        self._kernel = core.kernel
        self._requests = core.requests
        self._tiers = core.tiers
        self._block_size = core.block_size

    def storable_blocks(self, request_id: str, tier: str = "default") -> tuple[int, ...]:
        """The request's blocks that may be copied to ``tier`` now: validated, full,
        hashed, and not already stored or being stored there."""
        rec = self._core.record(request_id)
        arguments.tier(tier)
        blocks = self._kernel.blocks
        holds = self._tiers.holds
        out: list[int] = []
        for block_id in rec.blocks:
            block = blocks[block_id]
            if block.state not in STORABLE_STATES or block.block_hash is None:
                continue
            if not holds(block.block_hash, tier):
                out.append(block_id)
        return tuple(out)

    def storable_as(self, block_id: int, key: BlockHash) -> bool:
        """Whether block ``block_id`` may leave now as ``key`` (:func:`storable_as`)."""
        if type(block_id) is not int or not 0 <= block_id < self._core.num_blocks:
            block_id = self._core.block(block_id).block_id  # raises UnknownBlockError
        return storable_as(self._kernel.blocks[block_id], arguments.block_hash("key", key))

    def exit_epoch(self) -> int:
        """A number that changes whenever a block someone holds may have stopped being
        storable under its key: a quarantine (a failed step, an invalidation, an
        unvalidated release) or a rollback, anywhere in the pool. An exit that verified
        a request's leading blocks may trust its answer while this stays the same and
        the request holds those blocks (no step rewrites a full block its request
        holds). Evictions do not move it: only blocks nobody holds are evicted, so an
        exit asking about blocks a request no longer holds (a finished request's, freed
        before their copy) verifies them again. Pure read, O(1)."""
        c = self._kernel.counters
        return c.blocks_quarantined + c.hashes_invalidated + c.slots_zeroed

    def begin_store(self, block_id: int, tier: str = "default") -> StoreTicket:
        """Start copying a validated block to ``tier``; raises unless VALIDATED or later."""
        if type(block_id) is not int or not 0 <= block_id < self._core.num_blocks:
            block_id = self._core.block(block_id).block_id  # raises UnknownBlockError
        if type(tier) is not str:
            arguments.tier(tier)
        block = self._kernel.blocks[block_id]
        if block.state not in STORABLE_STATES or block.block_hash is None:
            raise NotStorableError(
                f"block {block_id} is {block.state.name}"
                + ("" if block.block_hash is not None else " without a hash")
                + "; only validated, full, hashed blocks may be stored to a tier "
                "(storable_blocks() lists a request's)"
            )
        self._kernel.counters.stores_started += 1
        return self._tiers.issue(
            block_id, block.block_hash, block.generation, tier, self._core.seal_of(block)
        )

    def _retire(self, ticket: StoreTicket) -> None:
        if type(ticket) is not StoreTicket:
            raise UnknownTicketError(
                f"expected the StoreTicket begin_store() returned, got {arguments.got(ticket)}"
            )
        held = self._tiers.tickets.get(ticket.ticket_id)
        if held is not ticket and held != ticket:  # (the ticket issued, or an equal copy)
            raise UnknownTicketError(
                f"store ticket {ticket.ticket_id} is not in flight (acknowledged or failed "
                "already, or issued by another pool); settle each ticket once, on the pool "
                "that issued it"
            )
        self._tiers.retire(ticket)

    def ack_store(self, ticket: StoreTicket) -> bool:
        """A tier acknowledged its copy. Returns True if registered (PUBLISHED blocks
        become OFFLOADED); False if the block was quarantined, invalidated or reused
        meanwhile — the tier must then discard the copy."""
        self._retire(ticket)
        kernel = self._kernel
        if not kernel.store_ack(ticket.block_id, ticket.block_hash, ticket.generation):
            kernel.counters.dropped_acks += 1
            return False
        parent = kernel.blocks[ticket.block_id].parent_hash
        self._tiers.add_copy(ticket.block_hash, parent, ticket.tier, ticket.seal)
        kernel.counters.stores_acknowledged += 1
        return True

    def fail_store(self, ticket: StoreTicket) -> None:
        """A tier reported that its copy failed; the block may be offered again."""
        self._retire(ticket)
        self._kernel.counters.stores_failed += 1

    def forget_tier_copy(self, tier: str, block_hash: BlockHash) -> bool:
        """A tier evicted its copy on its own; returns False if it held none."""
        return self._tiers.drop_copy(
            arguments.block_hash("block_hash", block_hash), arguments.tier(tier)
        )

    def block_seal(self, block_id: int) -> int | None:
        """The seal recorded when the block's KV was validated, or None: never sealed,
        or its bytes changed since (written again, released, quarantined)."""
        return self._core.seal_of(self._core.block(block_id))

    def tier_seal(self, block_hash: BlockHash, tier: str) -> int | None:
        """The seal ``tier``'s acknowledged copy of ``block_hash`` carries (None: the
        tier holds none, or an unsealed one). A load of the copy whose KV does not
        give this seal is not the validated KV: :meth:`invalidate` the hash."""
        key = (arguments.block_hash("block_hash", block_hash), arguments.tier(tier))
        return self._tiers.seals.get(key)

    def tier_copies(self, block_hash: BlockHash) -> tuple[str, ...]:
        """Tiers holding an acknowledged copy of ``block_hash``."""
        copies = self._tiers.copies.get(arguments.block_hash("block_hash", block_hash), ())
        return tuple(sorted(copies))

    def invalidate(
        self, block_hashes: Iterable[BlockHash], *, descendants: bool = True
    ) -> InvalidationReport:
        """Taint hashes found corrupt after the fact.

        Every GPU block carrying one leaves the prefix index and is QUARANTINED; every
        tier copy is reported for purging. With ``descendants`` (default) blocks chained
        after a tainted one are tainted too: their KV was computed attending to it.

        A request holding a tainted block computed everything after it on corrupt KV:
        it is aborted (a ``RequestAborted`` event; ``report.requests`` names it), its
        blocks past the first tainted one are quarantined (cached ones leave the index,
        which may reach more holders), and its validated boundary moves back to that
        block's start -- so
        :meth:`zero_request_tail` resumes it from before the taint (when it holds the
        tainted block alone), or it is freed. Until a tainted hash is published again
        by a step that computed it afresh, no block chained on it is published, on
        any path (block-level holders, which the pool cannot abort, included).
        """
        targets = dict.fromkeys(arguments.hash_list("block_hashes", block_hashes))
        arguments.flag("descendants", descendants)
        if descendants:
            self._add_descendants(targets)
        kernel = self._kernel
        removed: list[tuple[BlockHash, int]] = []  # (hash, id) of cached blocks dropped
        dropped = kernel.drop_hashes(targets, removed)
        # A request holding a dropped block computed what follows it on corrupt KV, so
        # its later blocks are tainted too; dropping cached ones among them can reach
        # more holders: repeat to a fixed point.
        first_tainted: dict[str, int] = {}
        while more := self._taint_tails(set(dropped), first_tainted):
            new = dict.fromkeys(h for h in more if h not in targets)
            targets.update(new)
            dropped.extend(kernel.drop_hashes(new, removed))
        kernel.tainted.update(targets)
        tier_copies = [
            (tier, block_hash) for block_hash in targets for tier in self._tiers.purge(block_hash)
        ]
        if removed and kernel.record_events:
            kernel.events.append(
                BlockRemoved(tuple(h for h, _ in removed), tuple(i for _, i in removed))
            )
        for rid, first in first_tainted.items():
            self._abort_tainted(self._requests[rid], first)
        kernel.counters.hashes_invalidated += len(targets)
        return InvalidationReport(
            tuple(targets), tuple(dropped), tuple(tier_copies), tuple(first_tainted)
        )

    def _add_descendants(self, targets: dict[BlockHash, None]) -> None:
        """Add every hash chained after one of ``targets`` (GPU blocks, tier copies)."""
        children: dict[BlockHash, list[BlockHash]] = {}
        for block in self._kernel.blocks:
            if block.block_hash is not None and block.parent_hash is not None:
                children.setdefault(block.parent_hash, []).append(block.block_hash)
        for child, parent in self._tiers.parents.items():
            if parent is not None:
                children.setdefault(parent, []).append(child)
        queue = list(targets)
        while queue:
            for child in children.get(queue.pop(), ()):
                if child not in targets:
                    targets[child] = None
                    queue.append(child)

    def _taint_tails(self, dropped: set[int], first_tainted: dict[str, int]) -> list[BlockHash]:
        """For each request holding a block of ``dropped``: note its first such table
        position in ``first_tainted``, quarantine its later unpublished blocks, and
        return the hashes of its later cached blocks (to be dropped next)."""
        more: list[BlockHash] = []
        for rid, rec in self._requests.items():
            first = next((i for i, b in enumerate(rec.blocks) if b in dropped), None)
            if first is None:
                continue
            if first_tainted.get(rid, first + 1) > first:
                first_tainted[rid] = first
            more.extend(self._kernel.quarantine_tail(rec.blocks[first + 1 :]))
        return more

    def _abort_tainted(self, rec: RequestRecord, first: int) -> None:
        """Abort a request whose block ``first`` was tainted: nothing it computed from
        there on counts as validated, and its in-flight results will be discarded."""
        size = self._block_size
        rec.num_validated = min(rec.num_validated, first * size)
        rec.publish_cursor = min(rec.publish_cursor, first)
        rec.discarded.extend(rec.pending)
        rec.pending.clear()
        kernel = self._kernel
        if not rec.aborted:
            rec.aborted = True
            kernel.counters.requests_aborted += 1
        if kernel.record_events:
            blocks = kernel.blocks
            quarantined = tuple(
                b for b in rec.blocks[first:] if blocks[b].state is BlockState.QUARANTINED
            )
            kernel.events.append(RequestAborted(rec.request_id, rec.num_validated, quarantined))
