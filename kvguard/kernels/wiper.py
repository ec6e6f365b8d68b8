"""Carry the pool's zeroing queues onto the device: the one place pool meets tensors.

The pool is sans-IO: it only *records* which blocks and token slots must be zeroed
(``take_blocks_to_zero()``, ``take_slots_to_zero()``). A :class:`CacheWiper` bound to a
pool and a cache layout drains both queues into the zeroing kernels, and turns the pool's
``zero_request_tail`` plan into wiped KV in one call::

    wiper = CacheWiper(pool, layout)
    ...                               # schedule a step: allocate / write
    wiper.flush()                     # before the step's forward pass runs
    ...                               # step failed on one rank
    wipe = wiper.zero_request_tail("req-7")
    resume_from = wipe.num_tokens     # the request continues from its surviving KV

Launches are asynchronous on CUDA; they are ordered before later work on the same stream,
so call :meth:`CacheWiper.flush` on the stream that runs the next forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvguard.kernels.backend import Backend
from kvguard.kernels.layout import KVCacheLayout, LayoutError
from kvguard.kernels.zero_blocks import zero_blocks
from kvguard.kernels.zero_slots import zero_slots
from kvguard.results import SlotRange, TailRollback

__all__ = ["CacheWiper", "FlushResult", "TailWipe", "ZeroingSource"]


class ZeroingSource(Protocol):
    """What the wiper needs from a pool (:class:`kvguard.BlockPool` provides it)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    def take_blocks_to_zero(self) -> list[int]: ...

    def take_slots_to_zero(self) -> list[SlotRange]: ...

    def zero_request_tail(self, request_id: str, num_tokens: int | None = None) -> TailRollback: ...


@dataclass(frozen=True, slots=True)
class FlushResult:
    """What one :meth:`CacheWiper.flush` wrote."""

    block_ids: tuple[int, ...]
    """Blocks zeroed whole, in every layer."""
    slots: tuple[SlotRange, ...]
    """Token slots zeroed, in every layer."""

    @property
    def num_slots(self) -> int:
        return sum(len(r) for r in self.slots)


@dataclass(frozen=True, slots=True)
class TailWipe:
    """What :meth:`CacheWiper.zero_request_tail` did to one request."""

    request_id: str
    num_tokens: int
    """The request's token boundary now: it resumes writing from here."""
    num_tokens_wiped: int
    """Tokens of this request rolled back and wiped."""
    slots: tuple[SlotRange, ...]
    """This request's slots that were wiped."""
    num_slots_wiped: int
    """Slots the launch wiped in all, including other requests' queued slots."""


class CacheWiper:
    """Drains ``pool``'s zeroing queues into ``layout``'s cache tensors.

    Raises :class:`~kvguard.kernels.layout.LayoutError` if the pool and the cache
    disagree on block size, or the pool has blocks the cache does not.
    """

    def __init__(
        self,
        pool: ZeroingSource,
        layout: KVCacheLayout,
        *,
        backend: Backend = "auto",
        max_programs: int | None = None,
    ) -> None:
        if pool.block_size != layout.block_size:
            raise LayoutError(
                f"pool block_size {pool.block_size} != cache block_size {layout.block_size} "
                f"({layout!r})"
            )
        if pool.num_blocks > layout.num_blocks:
            raise LayoutError(
                f"pool has {pool.num_blocks} blocks but the cache only {layout.num_blocks}; "
                "block ids past the cache would be zeroed out of bounds"
            )
        self.pool = pool
        self.layout = layout
        self.backend: Backend = backend
        self.max_programs = max_programs

    def flush(self) -> FlushResult:
        """Zero every queued block and slot now (at most two launches)."""
        block_ids = self.pool.take_blocks_to_zero()
        slots = self.pool.take_slots_to_zero()
        zero_blocks(self.layout, block_ids, backend=self.backend, max_programs=self.max_programs)
        self._wipe(slots)
        return FlushResult(tuple(block_ids), tuple(slots))

    def zero_request_tail(self, request_id: str, num_tokens: int | None = None) -> TailWipe:
        """Roll ``request_id`` back (pool) and wipe the dropped KV slots (one launch).

        ``num_tokens``: as :meth:`kvguard.BlockPool.zero_request_tail` — ``None`` drops
        everything past the validated boundary, an int drops exactly that many of the
        last written tokens. Pool errors (unknown request, a rollback into shared
        blocks) propagate before anything is wiped. Other slots already queued are
        wiped by the same launch; queued whole blocks are left for :meth:`flush`.
        """
        rollback = self.pool.zero_request_tail(request_id, num_tokens)
        queued = self.pool.take_slots_to_zero()
        # The pool queues the rollback's slots itself; add any it did not, so the wipe
        # never depends on that detail.
        seen = set(queued)
        slots = queued + [r for r in rollback.slots if r not in seen]
        wiped = self._wipe(slots)
        return TailWipe(
            request_id=request_id,
            num_tokens=rollback.num_tokens,
            num_tokens_wiped=rollback.num_tokens_wiped,
            slots=rollback.slots,
            num_slots_wiped=wiped,
        )

    def _wipe(self, slots: Sequence[SlotRange]) -> int:
        return zero_slots(self.layout, slots, backend=self.backend, max_programs=self.max_programs)
