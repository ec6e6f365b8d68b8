"""The tier gate's bookkeeping: stores in flight and acknowledged tier copies.

A store ticket records the block's *generation* when the copy started. The pool bumps a
block's generation whenever its bytes stop being the validated bytes the copy read
(reuse, quarantine, rollback, invalidation), so an acknowledgement that arrives after
that is recognised as late, dropped and counted, and the tier is told to discard its
copy (``ack_store`` returns False).
"""

from __future__ import annotations

from kvguard.hashing import BlockHash
from kvguard.results import StoreTicket


class TierLedger:
    __slots__ = ("_next_ticket", "copies", "in_flight", "parents", "tickets")

    def __init__(self) -> None:
        self._next_ticket = 0
        self.tickets: dict[int, StoreTicket] = {}
        self.in_flight: dict[tuple[BlockHash, str], int] = {}
        """(hash, tier) -> number of tickets in flight for it."""
        self.copies: dict[BlockHash, set[str]] = {}
        """hash -> tiers holding an acknowledged copy."""
        self.parents: dict[BlockHash, BlockHash | None] = {}
        """Parent hash of every hash some tier holds (taint propagates to children)."""

    def issue(
        self, block_id: int, block_hash: BlockHash, generation: int, tier: str
    ) -> StoreTicket:
        ticket = StoreTicket(self._next_ticket, block_id, block_hash, generation, tier)
        self._next_ticket += 1
        self.tickets[ticket.ticket_id] = ticket
        key = (block_hash, tier)
        self.in_flight[key] = self.in_flight.get(key, 0) + 1
        return ticket

    def retire(self, ticket: StoreTicket) -> None:
        del self.tickets[ticket.ticket_id]
        key = (ticket.block_hash, ticket.tier)
        left = self.in_flight[key] - 1
        if left:
            self.in_flight[key] = left
        else:
            del self.in_flight[key]

    def holds(self, block_hash: BlockHash, tier: str) -> bool:
        """True if ``tier`` has, or is getting, a copy of ``block_hash``."""
        return tier in self.copies.get(block_hash, ()) or (block_hash, tier) in self.in_flight

    def add_copy(self, block_hash: BlockHash, parent: BlockHash | None, tier: str) -> None:
        self.copies.setdefault(block_hash, set()).add(tier)
        self.parents[block_hash] = parent

    def drop_copy(self, block_hash: BlockHash, tier: str) -> bool:
        tiers = self.copies.get(block_hash)
        if tiers is None or tier not in tiers:
            return False
        tiers.discard(tier)
        if not tiers:
            del self.copies[block_hash]
            del self.parents[block_hash]
        return True

    def purge(self, block_hash: BlockHash) -> tuple[str, ...]:
        """Forget every tier copy of ``block_hash``; return the tiers that held one."""
        tiers = self.copies.pop(block_hash, set())
        self.parents.pop(block_hash, None)
        return tuple(sorted(tiers))
