"""The tier gate's bookkeeping: stores in flight and acknowledged tier copies.

A store ticket records the block's *generation* when the copy started. The pool bumps a
block's generation whenever its bytes stop being the validated bytes the copy read
(reuse, quarantine, rollback, invalidation), so an acknowledgement that arrives after
that is recognised as late, dropped and counted, and the tier is told to discard its
copy (``ack_store`` returns False).
"""

from __future__ import annotations

from dataclasses import fields

from kvguard.hashing import BlockHash
from kvguard.results import StoreTicket

# StoreTicket is a frozen dataclass: its generated __init__ sets each field through
# object.__setattr__ (about 1 us). One ticket per stored block makes issuing them the
# tier gate's hot path, so they are built with their slots' own descriptors, a third
# of that; the result is the same frozen StoreTicket.
_new_object = object.__new__
_set_ticket_id = StoreTicket.__dict__["ticket_id"].__set__
_set_block_id = StoreTicket.__dict__["block_id"].__set__
_set_block_hash = StoreTicket.__dict__["block_hash"].__set__
_set_generation = StoreTicket.__dict__["generation"].__set__
_set_tier = StoreTicket.__dict__["tier"].__set__
_set_seal = StoreTicket.__dict__["seal"].__set__
assert [f.name for f in fields(StoreTicket)] == [
    "ticket_id",
    "block_id",
    "block_hash",
    "generation",
    "tier",
    "seal",
], "StoreTicket's fields changed: update the setters above"
assert not hasattr(StoreTicket, "__post_init__"), "_issue_ticket would skip __post_init__"


def _issue_ticket(
    ticket_id: int,
    block_id: int,
    block_hash: BlockHash,
    generation: int,
    tier: str,
    seal: int | None,
) -> StoreTicket:
    """``StoreTicket(ticket_id, block_id, block_hash, generation, tier, seal)``, faster."""
    ticket: StoreTicket = _new_object(StoreTicket)
    _set_ticket_id(ticket, ticket_id)
    _set_block_id(ticket, block_id)
    _set_block_hash(ticket, block_hash)
    _set_generation(ticket, generation)
    _set_tier(ticket, tier)
    _set_seal(ticket, seal)
    return ticket


class TierLedger:
    __slots__ = ("_next_ticket", "copies", "in_flight", "parents", "seals", "tickets")

    def __init__(self) -> None:
        self._next_ticket = 0
        self.tickets: dict[int, StoreTicket] = {}
        self.in_flight: dict[tuple[BlockHash, str], int] = {}
        """(hash, tier) -> number of tickets in flight for it."""
        self.copies: dict[BlockHash, set[str]] = {}
        """hash -> tiers holding an acknowledged copy."""
        self.parents: dict[BlockHash, BlockHash | None] = {}
        """Parent hash of every hash some tier holds (taint propagates to children)."""
        self.seals: dict[tuple[BlockHash, str], int] = {}
        """(hash, tier) -> the seal that tier's copy carries (sealed copies only)."""

    def issue(
        self,
        block_id: int,
        block_hash: BlockHash,
        generation: int,
        tier: str,
        seal: int | None = None,
    ) -> StoreTicket:
        ticket = _issue_ticket(self._next_ticket, block_id, block_hash, generation, tier, seal)
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

    def add_copy(
        self, block_hash: BlockHash, parent: BlockHash | None, tier: str, seal: int | None = None
    ) -> None:
        tiers = self.copies.get(block_hash)
        if tiers is None:
            self.copies[block_hash] = {tier}
        else:
            tiers.add(tier)
        self.parents[block_hash] = parent
        if seal is not None:
            self.seals[(block_hash, tier)] = seal
        elif self.seals:
            self.seals.pop((block_hash, tier), None)

    def drop_copy(self, block_hash: BlockHash, tier: str) -> bool:
        tiers = self.copies.get(block_hash)
        if tiers is None or tier not in tiers:
            return False
        tiers.discard(tier)
        if self.seals:
            self.seals.pop((block_hash, tier), None)
        if not tiers:
            del self.copies[block_hash]
            del self.parents[block_hash]
        return True

    def purge(self, block_hash: BlockHash) -> tuple[str, ...]:
        """Forget every tier copy of ``block_hash``; return the tiers that held one."""
        tiers = self.copies.pop(block_hash, set())
        self.parents.pop(block_hash, None)
        for tier in tiers:
            self.seals.pop((block_hash, tier), None)
        return tuple(sorted(tiers))
