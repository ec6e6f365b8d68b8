"""kvguard's block pool: KV is shared or offloaded only after the step that wrote it passed.

The pool is sans-IO: it never touches tensors. It keeps every block's state (see
:mod:`kvguard.states`), the prefix index, a per-request write/validate ledger, and three
queues the engine drains — blocks and token slots to zero (``take_blocks_to_zero``,
``take_slots_to_zero``) and events (``take_events``).

A request's life, as an engine drives it::

    pool.add_request("r1", prompt_token_ids)
    # Only PUBLISHED/OFFLOADED blocks; the last prompt token stays out of the hit (a
    # step computes at least one token, as in vLLM).
    hit = pool.lookup("r1", max_tokens=len(prompt_token_ids) - 1)
    pool.allocate("r1", len(prompt_token_ids), hit=hit)
    pool.write("r1", len(prompt_token_ids) - hit.num_tokens)   # the step is scheduled
    ...                                         # the forward pass runs
    pool.validate_step("r1")    # or pool.fail_step("r1"): abort r1 alone
    pool.free("r1")

Every method either does all of its work or raises a typed error having changed nothing.
Set ``KVGUARD_CHECK_INVARIANTS=1`` (or pass ``check_invariants=True``) to run
:meth:`BlockPool.check_invariants` after every mutating call.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ParamSpec, TypeVar, cast

from kvguard import arguments
from kvguard.block import Block, BlockInfo, PendingPublication
from kvguard.block_steps import BlockSteps
from kvguard.errors import PoolMisuseError
from kvguard.events import AllBlocksCleared, PoolEvent
from kvguard.hashing import BlockHash, BlockHasher, default_block_hasher
from kvguard.invariants import PoolSnapshot, check_pool, take_snapshot
from kvguard.pool_core import PoolCore
from kvguard.recovery import Recovery
from kvguard.request_steps import RequestSteps
from kvguard.results import (
    BlockValidation,
    InvalidationReport,
    PrefixHit,
    PublishOutcome,
    RequestProgress,
    SlotRange,
    StepResult,
    StoreTicket,
    TailRollback,
    TokenRange,
)
from kvguard.states import MATCHABLE_STATES, BlockState
from kvguard.stats import Counters, PoolStats
from kvguard.tier_gate import TierGate
from kvguard.zeroing import ZeroPolicy

_F = TypeVar("_F", bound=Callable[..., Any])
_P = ParamSpec("_P")
_R = TypeVar("_R")
_T = TypeVar("_T")

CHECK_INVARIANTS_ENV = "KVGUARD_CHECK_INVARIANTS"

# Public methods that change the pool; wrapped with an invariant check when asked for.
# Every public method is in exactly one of _MUTATORS and _READERS, and a reader leaves
# snapshot() as it was (tests/test_public_api.py checks both).
_MUTATORS = (
    "add_request",
    "lookup",
    "take_blocks_to_zero",
    "take_slots_to_zero",
    "take_events",
    "append_tokens",
    "append_block_hashes",
    "allocate",
    "write",
    "validate_step",
    "fail_step",
    "free",
    "zero_request_tail",
    "roll_back_blocks",
    "allocate_blocks",
    "acquire_blocks",
    "release_blocks",
    "write_blocks",
    "validate_blocks",
    "fail_blocks",
    "publish_block",
    "disown_reference",
    "begin_store",
    "ack_store",
    "fail_store",
    "forget_tier_copy",
    "invalidate",
    "reset_prefix_cache",
)
_READERS = (
    "block_hash",
    "block_info",
    "block_seal",
    "block_state",
    "block_table",
    "cached_block_id",
    "can_allocate",
    "check_invariants",
    "counters",
    "free_block_ids",
    "get_num_free_blocks",
    "progress",
    "snapshot",
    "stats",
    "storable_blocks",
    "tier_copies",
    "tier_seal",
)
# The mutators the pool implements itself (the others are its façades' methods).
_OWN_MUTATORS = tuple(
    name
    for name in _MUTATORS
    if not any(name in vars(facade) for facade in (RequestSteps, BlockSteps, TierGate, Recovery))
)


def _contract(facade_method: Callable[..., object]) -> Callable[[_F], _F]:
    """Give a pool method the docstring of the façade method it delegates to: the
    contract is written once, where it is implemented, and ``help()`` shows it."""

    def document(method: _F) -> _F:
        method.__doc__ = facade_method.__doc__
        return method

    return document


def _checking(method: Callable[_P, _R], check: Callable[[], None]) -> Callable[_P, _R]:
    """``method``, then ``check()`` once it returned (the invariant-checking mode)."""

    @functools.wraps(method)
    def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        result = method(*args, **kwargs)
        check()
        return result

    return checked


def _facade_class(facade: type[_T], check: Callable[[], None] | None) -> type[_T]:
    """The façade class ``facade``, or with ``check``, a subclass of it whose mutators
    (``_MUTATORS``) run ``check`` after they return: the pool's methods delegate to its
    façade objects and hot callers call those directly, so the check sits on them."""
    if check is None:
        return facade
    checked = {
        name: _checking(method, check) for name, method in vars(facade).items() if name in _MUTATORS
    }
    name = f"Checked{facade.__name__}"
    return cast("type[_T]", type(name, (facade,), {"__slots__": (), **checked}))


class BlockPool:
    """A validation-gated pool of ``num_blocks`` KV-cache blocks of ``block_size`` tokens.

    ``enable_caching`` turns the prefix index on (validated full blocks are published);
    ``zero_policy`` chooses which reused blocks the engine must zero (default: only
    suspect ones); ``hasher`` replaces the default chained BLAKE2b block hasher.
    ``record_events=False`` stops filling :meth:`take_events` (for engines that build
    their own events and never drain kvguard's). ``block_type`` is the class of the
    pool's block records, a subclass of :class:`~kvguard.block.Block` that may carry an
    engine's own fields, so that the engine reads reference counts, hashes and states
    from kvguard's records instead of keeping copies (the vLLM adapter's blocks are
    what vLLM reads as its ``KVCacheBlock`` objects).

    The pool is composed of four façades over one shared core (:mod:`kvguard.pool_core`),
    each of which checks its arguments and calls the transition kernel; the pool's
    methods of the same names delegate to them. They are read-only attributes, for
    callers on per-step hot paths that call a façade directly (one call frame less):

    - ``request_steps`` (:class:`~kvguard.request_steps.RequestSteps`): requests, their
      block tables and write/validate ledgers;
    - ``block_steps`` (:class:`~kvguard.block_steps.BlockSteps`): blocks the caller names
      and holds in its own tables;
    - ``tier_gate`` (:class:`~kvguard.tier_gate.TierGate`): stores to lower tiers, and
      invalidation;
    - ``recovery`` (:class:`~kvguard.recovery.Recovery`): rolling requests and blocks back.

    With ``check_invariants``, a mutating call checks the pool after it returns, whether
    it is made on the pool or on a façade.
    """

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
        check_invariants: bool | None = None,
    ) -> None:
        core = PoolCore(
            num_blocks,
            block_size,
            enable_caching=enable_caching,
            zero_policy=zero_policy,
            hasher=hasher,
            record_events=record_events,
            block_type=block_type,
        )
        if check_invariants is None:
            check_invariants = os.environ.get(CHECK_INVARIANTS_ENV, "") not in ("", "0")
        arguments.flag("check_invariants", check_invariants)
        self._core = core
        self._kernel = core.kernel
        check = self.check_invariants if check_invariants else None
        self._request_steps = _facade_class(RequestSteps, check)(core)
        self._block_steps = _facade_class(BlockSteps, check)(core)
        self._tier_gate = _facade_class(TierGate, check)(core)
        self._recovery = _facade_class(Recovery, check)(core)
        if check is not None:
            for name in _OWN_MUTATORS:
                setattr(self, name, _checking(getattr(self, name), check))
        self._index_view = MappingProxyType(core.kernel.index)

    def __repr__(self) -> str:
        """Size and where the blocks are, from counts the pool keeps anyway: O(1), no
        walk over the blocks (``stats()`` counts blocks by state)."""
        name = type(self).__name__
        core = getattr(self, "_core", None)
        if core is None:  # (a subclass's __init__ failed before building the pool)
            return f"<{name}, not built>"
        free = core.kernel.free
        return (
            f"<{name} num_blocks={core.num_blocks} block_size={core.block_size} "
            f"held={core.num_blocks - free.size} allocatable={free.size} "
            f"(empty={len(free.empty)} quarantined={len(free.quarantined)} "
            f"evictable={free.num_evictable}) cached={len(core.kernel.index)} "
            f"requests={len(core.requests)}>"
        )

    # The pool's settings, fixed at construction.
    @property
    def num_blocks(self) -> int:
        return self._core.num_blocks

    @property
    def block_size(self) -> int:
        return self._core.block_size

    @property
    def enable_caching(self) -> bool:
        return self._kernel.enable_caching

    @property
    def zero_policy(self) -> ZeroPolicy:
        return self._kernel.zero_policy

    @property
    def record_events(self) -> bool:
        return self._kernel.record_events

    # The façades (see the class docstring).
    @property
    def request_steps(self) -> RequestSteps:
        return self._request_steps

    @property
    def block_steps(self) -> BlockSteps:
        return self._block_steps

    @property
    def tier_gate(self) -> TierGate:
        return self._tier_gate

    @property
    def recovery(self) -> Recovery:
        return self._recovery

    # Request steps (kvguard.request_steps). Each method below is its façade's, by
    # explicit delegation: same signature, the façade's docstring (``_contract``).
    @_contract(RequestSteps.add_request)
    def add_request(
        self,
        request_id: str,
        token_ids: Sequence[int] = (),
        *,
        salt: bytes | None = None,
        block_hashes: Sequence[BlockHash] | None = None,
        retention: int = 0,
    ) -> None:
        return self._request_steps.add_request(
            request_id, token_ids, salt=salt, block_hashes=block_hashes, retention=retention
        )

    @_contract(RequestSteps.append_tokens)
    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> tuple[int, ...]:
        return self._request_steps.append_tokens(request_id, token_ids)

    @_contract(RequestSteps.append_block_hashes)
    def append_block_hashes(
        self, request_id: str, block_hashes: Sequence[BlockHash]
    ) -> tuple[int, ...]:
        return self._request_steps.append_block_hashes(request_id, block_hashes)

    @_contract(RequestSteps.lookup)
    def lookup(self, request_id: str, *, max_tokens: int | None = None) -> PrefixHit:
        return self._request_steps.lookup(request_id, max_tokens=max_tokens)

    @_contract(RequestSteps.can_allocate)
    def can_allocate(
        self, request_id: str, num_tokens: int, *, hit: PrefixHit | None = None
    ) -> bool:
        return self._request_steps.can_allocate(request_id, num_tokens, hit=hit)

    @_contract(RequestSteps.allocate)
    def allocate(
        self, request_id: str, num_tokens: int, *, hit: PrefixHit | None = None
    ) -> tuple[int, ...]:
        return self._request_steps.allocate(request_id, num_tokens, hit=hit)

    @_contract(RequestSteps.write)
    def write(self, request_id: str, num_tokens: int) -> TokenRange:
        return self._request_steps.write(request_id, num_tokens)

    @_contract(RequestSteps.validate_step)
    def validate_step(self, request_id: str, seals: Mapping[int, int] | None = None) -> StepResult:
        return self._request_steps.validate_step(request_id, seals)

    @_contract(RequestSteps.fail_step)
    def fail_step(self, request_id: str) -> StepResult:
        return self._request_steps.fail_step(request_id)

    @_contract(RequestSteps.free)
    def free(self, request_id: str) -> None:
        return self._request_steps.free(request_id)

    @_contract(RequestSteps.block_table)
    def block_table(self, request_id: str) -> tuple[int, ...]:
        return self._request_steps.block_table(request_id)

    @_contract(RequestSteps.progress)
    def progress(self, request_id: str) -> RequestProgress:
        return self._request_steps.progress(request_id)

    @property
    def request_ids(self) -> tuple[str, ...]:
        """The open requests, in the order they were added."""
        return tuple(self._core.requests)

    # Fault recovery (kvguard.recovery).
    @_contract(Recovery.zero_request_tail)
    def zero_request_tail(self, request_id: str, num_tokens: int | None = None) -> TailRollback:
        return self._recovery.zero_request_tail(request_id, num_tokens)

    @_contract(Recovery.roll_back_blocks)
    def roll_back_blocks(self, tails: Mapping[int, int]) -> tuple[SlotRange, ...]:
        return self._recovery.roll_back_blocks(tails)

    # Block-level steps (kvguard.block_steps).
    @_contract(BlockSteps.allocate_blocks)
    def allocate_blocks(self, num_blocks: int, *, write: bool = False) -> list[int]:
        return self._block_steps.allocate_blocks(num_blocks, write=write)

    @_contract(BlockSteps.acquire_blocks)
    def acquire_blocks(self, block_ids: Iterable[int]) -> None:
        return self._block_steps.acquire_blocks(block_ids)

    @_contract(BlockSteps.release_blocks)
    def release_blocks(self, block_ids: Iterable[int], *, steps_passed: bool = False) -> None:
        return self._block_steps.release_blocks(block_ids, steps_passed=steps_passed)

    @_contract(BlockSteps.write_blocks)
    def write_blocks(self, block_ids: Iterable[int]) -> None:
        return self._block_steps.write_blocks(block_ids)

    @_contract(BlockSteps.validate_blocks)
    def validate_blocks(
        self,
        block_ids: Iterable[int],
        publish: Mapping[int, PendingPublication] | None = None,
        seals: Mapping[int, int] | None = None,
    ) -> BlockValidation:
        return self._block_steps.validate_blocks(block_ids, publish, seals)

    @_contract(BlockSteps.fail_blocks)
    def fail_blocks(self, block_ids: Iterable[int]) -> tuple[int, ...]:
        return self._block_steps.fail_blocks(block_ids)

    @_contract(BlockSteps.publish_block)
    def publish_block(
        self,
        block_id: int,
        block_hash: BlockHash,
        parent_hash: BlockHash | None = None,
        *,
        owner: str = "",
    ) -> PublishOutcome:
        return self._block_steps.publish_block(block_id, block_hash, parent_hash, owner=owner)

    @_contract(BlockSteps.disown_reference)
    def disown_reference(self, block_id: int) -> None:
        return self._block_steps.disown_reference(block_id)

    @_contract(BlockSteps.cached_block_id)
    def cached_block_id(self, block_hash: BlockHash) -> int | None:
        return self._block_steps.cached_block_id(block_hash)

    # The tier gate (kvguard.tier_gate).
    @_contract(TierGate.storable_blocks)
    def storable_blocks(self, request_id: str, tier: str = "default") -> tuple[int, ...]:
        return self._tier_gate.storable_blocks(request_id, tier)

    @_contract(TierGate.begin_store)
    def begin_store(self, block_id: int, tier: str = "default") -> StoreTicket:
        return self._tier_gate.begin_store(block_id, tier)

    @_contract(TierGate.ack_store)
    def ack_store(self, ticket: StoreTicket) -> bool:
        return self._tier_gate.ack_store(ticket)

    @_contract(TierGate.fail_store)
    def fail_store(self, ticket: StoreTicket) -> None:
        return self._tier_gate.fail_store(ticket)

    @_contract(TierGate.forget_tier_copy)
    def forget_tier_copy(self, tier: str, block_hash: BlockHash) -> bool:
        return self._tier_gate.forget_tier_copy(tier, block_hash)

    @_contract(TierGate.tier_copies)
    def tier_copies(self, block_hash: BlockHash) -> tuple[str, ...]:
        return self._tier_gate.tier_copies(block_hash)

    @_contract(TierGate.block_seal)
    def block_seal(self, block_id: int) -> int | None:
        return self._tier_gate.block_seal(block_id)

    @_contract(TierGate.tier_seal)
    def tier_seal(self, block_hash: BlockHash, tier: str) -> int | None:
        return self._tier_gate.tier_seal(block_hash, tier)

    @_contract(TierGate.invalidate)
    def invalidate(
        self, block_hashes: Iterable[BlockHash], *, descendants: bool = True
    ) -> InvalidationReport:
        return self._tier_gate.invalidate(block_hashes, descendants=descendants)

    def reset_prefix_cache(self, *, keep_held: Iterable[int] = ()) -> bool:
        """Drop every cached block from the index; only when no block is held.

        Returns False (changing nothing) while any block has a reference, as vLLM does.
        Blocks in ``keep_held`` may stay referenced (a holder's permanent placeholder,
        such as vLLM's null block); they must not be cached.
        """
        held = arguments.id_list(keep_held)
        if held:
            held = arguments.block_ids(held, self.num_blocks)  # raises UnknownBlockError
        kept = set(held)
        kernel = self._kernel
        if any(block.ref_cnt for block in kernel.blocks if block.block_id not in kept):
            return False
        if any(kernel.blocks[b].state in MATCHABLE_STATES for b in kept):
            raise PoolMisuseError(
                "keep_held names a cached (PUBLISHED/OFFLOADED) block; keep_held is for "
                "held placeholders that are never cached: release it first"
            )
        kernel.evict_all()
        if self.record_events:
            kernel.events.append(AllBlocksCleared())
        return True

    def take_blocks_to_zero(self) -> list[int]:
        """Block ids the engine must zero (every layer) before its next step runs."""
        return self._kernel.zero.take_blocks()

    def take_slots_to_zero(self) -> list[SlotRange]:
        """Token slots the engine must wipe (every layer) before its next step runs."""
        return self._kernel.zero.take_slots()

    def take_events(self) -> list[PoolEvent]:
        """Events since the last call, oldest first."""
        events = self._kernel.events
        out = events[:]
        events.clear()  # in place: the kernel's compiled twins append to this list
        return out

    @property
    def prefix_index(self) -> Mapping[BlockHash, int]:
        """The prefix index, read-only: hash -> id of the PUBLISHED/OFFLOADED block
        holding it (``prefix_index.get`` is :meth:`cached_block_id` without a Python
        call, for per-lookup hot paths)."""
        return self._index_view

    @property
    def block_records(self) -> Sequence[Block]:
        """The pool's block records, indexed by block id (of ``block_type``).

        For engines that read fields off them in their hot paths (the vLLM adapter
        hands them to vLLM as its blocks). Read-only by contract: kvguard writes them;
        :meth:`block_info` is the checked, snapshot way to look at one block.
        """
        return self._kernel.blocks

    def block_info(self, block_id: int) -> BlockInfo:
        block = self._core.block(block_id)
        return BlockInfo.of(block, self._kernel.retention.get(block.block_id, 0))

    def block_state(self, block_id: int) -> BlockState:
        """The block's state alone (no snapshot object: for per-step hot paths)."""
        return self._core.block(block_id).state

    def block_hash(self, block_id: int) -> BlockHash | None:
        """The block's hash alone (None unless validated, full and hashed)."""
        return self._core.block(block_id).block_hash

    def get_num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free, quarantined and evictable)."""
        return self._kernel.free.size

    def free_block_ids(self, after: int | None = None) -> Iterator[int]:
        """The ids of the blocks an allocation can take, in the order it takes them:
        quarantined first, then empty, then cached ones (least recently released first,
        lowest retention class first) -- from the first, or after block ``after``
        (nothing after a block that is held). For engines that walk the free list
        (vLLM's lazy CPU offloading); the pool must not change while the iteration runs.
        """
        free = self._kernel.free
        if after is None:
            return free.in_order()
        return free.in_order(self._core.block(after))

    def stats(self) -> PoolStats:
        kernel = self._kernel
        return PoolStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            blocks_by_state=self._blocks_by_state(),
            num_free=kernel.free.size,
            num_evictable=kernel.free.num_evictable,
            num_requests=len(self._core.requests),
            zero_queue_blocks=len(kernel.zero.blocks),
            zero_queue_slots=len(kernel.zero.pending_slots()),
            stores_in_flight=len(self._core.tiers.tickets),
            counters=dataclasses.replace(kernel.counters),
        )

    def counters(self) -> Counters:
        """A copy of the cumulative counters alone: ``stats().counters`` without the
        walk over every block (for callers that read them every step)."""
        return dataclasses.replace(self._kernel.counters)

    def _blocks_by_state(self) -> dict[BlockState, int]:
        """Counted by walking the blocks: O(num_blocks), paid by stats() callers only,
        so that no transition on the hot paths has to keep a tally."""
        counts = dict.fromkeys(BlockState, 0)
        for state, n in Counter(block.state for block in self._kernel.blocks).items():
            counts[state] = n
        return counts

    def check_invariants(self) -> None:
        """Walk the whole pool; raise :class:`InvariantViolation` describing what broke."""
        check_pool(self)

    def snapshot(self) -> PoolSnapshot:
        """Everything observable about the pool, as one comparable value."""
        return take_snapshot(self)
