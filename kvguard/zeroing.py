"""Zero-on-reuse: the policy and the sans-IO queue the engine drains.

The pool never touches tensors. It records which blocks (and, after a tail rollback,
which token slots) must be wiped before the engine's next step runs; the engine drains
the queue with ``take_blocks_to_zero()`` / ``take_slots_to_zero()`` — the way vLLM's
scheduler fills ``SchedulerOutput.new_block_ids_to_zero`` — and wipes them on the device
(``kvguard.kernels``).
"""

from __future__ import annotations

import enum

from kvguard.results import SlotRange


class ZeroPolicy(enum.Enum):
    SUSPECT = "suspect"
    """Zero only blocks that may hold unvalidated or corrupt bytes (the default)."""
    ALL = "all"
    """Zero every newly allocated block (vLLM PR #50283's behaviour)."""
    NONE = "none"
    """Never zero; quarantined blocks are still never matchable or stored."""


class ZeroQueue:
    __slots__ = ("_slots", "blocks")

    def __init__(self) -> None:
        # An insertion-ordered set: a block re-queued before a drain is wiped once.
        # Public for the transition kernel's compiled allocate, which adds to this very
        # dict: take_blocks() therefore clears it in place, never replaces it.
        self.blocks: dict[int, None] = {}
        self._slots: list[SlotRange] = []

    def add_block(self, block_id: int) -> None:
        self.blocks[block_id] = None

    def add_slots(self, slots: tuple[SlotRange, ...]) -> None:
        self._slots.extend(slots)

    def take_blocks(self) -> list[int]:
        out = list(self.blocks)
        self.blocks.clear()
        return out

    def take_slots(self) -> list[SlotRange]:
        out = self._slots
        self._slots = []
        return out

    def pending_blocks(self) -> tuple[int, ...]:
        return tuple(self.blocks)

    def pending_slots(self) -> tuple[SlotRange, ...]:
        return tuple(self._slots)
