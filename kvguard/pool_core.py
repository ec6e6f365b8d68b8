"""What the pool's façades share: the transition kernel and the request records.

:class:`kvguard.BlockPool` is composed of four façades -- request steps, block-level
steps, the tier gate, fault recovery -- each an object of its own module's class, built
on one :class:`PoolCore`. The core holds what they share and nothing else: ``kernel``
(:class:`~kvguard.transition_kernel.TransitionKernel`: the pool's blocks, queues and
index, and the only writer of block states), ``requests`` (the request records,
:mod:`kvguard.request_record`), ``tiers`` (the tier gate's ledger, which ``stats()``
reads too) and ``hasher``, plus the lookups of a request or a block that turn a bad
name into a typed error. A façade reaches no other façade.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvguard import arguments
from kvguard.block import Block
from kvguard.errors import PoolMisuseError, RequestAbortedError, UnknownRequestError
from kvguard.hashing import BlockHasher, default_block_hasher
from kvguard.request_record import RequestRecord
from kvguard.states import STORABLE_STATES
from kvguard.tiers import TierLedger
from kvguard.transition_kernel import TransitionKernel
from kvguard.zeroing import ZeroPolicy


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PoolCore:
    """The shared state of the façades; see :class:`kvguard.BlockPool` for the API."""

    __slots__ = ("block_size", "hasher", "kernel", "num_blocks", "requests", "seals", "tiers")

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        zero_policy: ZeroPolicy = ZeroPolicy.SUSPECT,
        hasher: BlockHasher = default_block_hasher,
        record_events: bool = True,
        block_type: type[Block] = Block,
    ) -> None:
        num_blocks = arguments.integer("num_blocks", num_blocks)
        if num_blocks < 1:
            raise PoolMisuseError(f"num_blocks must be at least 1, got {num_blocks}")
        block_size = arguments.integer("block_size", block_size)
        if block_size < 1:
            raise PoolMisuseError(f"block_size must be at least 1, got {block_size}")
        if not isinstance(zero_policy, ZeroPolicy):
            raise PoolMisuseError(
                f"zero_policy must be a kvguard.ZeroPolicy, got {arguments.got(zero_policy)}"
            )
        if not (isinstance(block_type, type) and issubclass(block_type, Block)):
            raise PoolMisuseError(
                f"block_type must be a subclass of kvguard.block.Block, got "
                f"{arguments.got(block_type)}"
            )
        if not callable(hasher):
            raise PoolMisuseError(
                f"hasher must be callable as (parent, tokens, salt) -> bytes, got "
                f"{arguments.got(hasher)}"
            )
        arguments.flag("enable_caching", enable_caching)
        arguments.flag("record_events", record_events)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hasher = hasher
        self.kernel = TransitionKernel(
            num_blocks,
            enable_caching=enable_caching,
            zero_policy=zero_policy,
            record_events=record_events,
            block_type=block_type,
        )
        self.requests: dict[str, RequestRecord] = {}
        self.tiers = TierLedger()
        self.seals: dict[int, tuple[int, int]] = {}
        """Block id -> (its generation, its seal) as recorded when a step validated it
        (``validate_blocks(..., seals=...)``). A seal holds while the block keeps that
        generation and stays VALIDATED or later (:meth:`seal_of`); every later
        validation of the block records its own seal, or none."""

    def record_seals(
        self, named: Iterable[int], validated: Iterable[int], seals: Mapping[int, int]
    ) -> None:
        """After a validation: each block it named loses the seal it had (its bytes were
        written again), and each one it validated with a seal in ``seals`` records it
        (checked already)."""
        recorded = self.seals
        if recorded:
            pop = recorded.pop
            for block_id in named:
                pop(block_id, None)
        if not seals:
            return
        blocks = self.kernel.blocks
        get = seals.get
        new = {
            block_id: (blocks[block_id].generation, seal)
            for block_id in validated
            if (seal := get(block_id)) is not None
        }
        recorded.update(new)
        self.kernel.counters.blocks_sealed += len(new)

    def seal_of(self, block: Block) -> int | None:
        """The block's seal, or None (never sealed, or its bytes changed since)."""
        recorded = self.seals.get(block.block_id)
        if (
            recorded is None
            or recorded[0] != block.generation
            or block.state not in STORABLE_STATES
        ):
            return None
        return recorded[1]

    def record(self, request_id: str) -> RequestRecord:
        try:
            return self.requests[request_id]
        except (KeyError, TypeError):  # TypeError: unhashable, not a str
            raise UnknownRequestError(arguments.request_id(request_id)) from None

    def pop_record(self, request_id: str) -> RequestRecord:
        """Close the request: its record, taken out of the pool (``free``)."""
        try:
            return self.requests.pop(request_id)
        except (KeyError, TypeError):  # TypeError: unhashable, not a str
            raise UnknownRequestError(
                arguments.request_id(request_id),
                f"free({request_id!r}): no request with this id is open -- freed already, "
                "or never added with add_request(); free() each request once",
            ) from None

    def live_record(self, request_id: str) -> RequestRecord:
        rec = self.record(request_id)
        if rec.aborted:
            raise RequestAbortedError(
                f"request {request_id!r} was aborted by a failed step; free() it, or "
                "zero_request_tail() it to resume from its validated prefix"
            )
        return rec

    def block(self, block_id: int) -> Block:
        """The block record of ``block_id`` (an int, or an integer-like converted);
        :class:`UnknownBlockError` names an id outside the pool or of another type."""
        if type(block_id) is not int or not 0 <= block_id < self.num_blocks:
            block_id = arguments.block_id(block_id, self.num_blocks)
        return self.kernel.blocks[block_id]
