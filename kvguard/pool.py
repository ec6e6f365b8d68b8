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
import operator
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Concatenate, ParamSpec, TypeVar

from kvguard import arguments
from kvguard.block import Block, BlockInfo
from kvguard.block_steps import BlockSteps
from kvguard.errors import PoolMisuseError
from kvguard.events import AllBlocksCleared, PoolEvent
from kvguard.hashing import BlockHash, BlockHasher, default_block_hasher
from kvguard.invariants import PoolSnapshot, check_pool, take_snapshot
from kvguard.pool_core import PoolCore
from kvguard.recovery import Recovery
from kvguard.request_steps import RequestSteps
from kvguard.results import SlotRange
from kvguard.states import MATCHABLE_STATES, BlockState
from kvguard.stats import Counters, PoolStats
from kvguard.tier_gate import TierGate
from kvguard.zeroing import ZeroPolicy

_F = TypeVar("_F", bound=Callable[..., Any])
_P = ParamSpec("_P")
_R = TypeVar("_R")

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
)


# Each façade method BlockPool exposes, by name: the attribute of the façade object
# that implements it (filled by _forwarded below).
_FACADE_OF: dict[str, str] = {}


def _forwarded(
    facade: str, method: Callable[Concatenate[Any, _P], _R]
) -> Callable[Concatenate[BlockPool, _P], _R]:
    """``method`` of the façade object ``BlockPool.<facade>``, as a method of the pool.

    What the class carries (its signature and docstring are the façade method's, for
    readers, ``help()`` and type checkers). A pool calls the façade's bound method
    directly: ``BlockPool.__init__`` binds it on the instance (no forwarding frame on
    the hot paths); the forwarder built here runs only when the class attribute is
    called, as ``BlockPool.allocate(pool, ...)``.
    """
    name = method.__name__
    _FACADE_OF[name] = facade
    get_facade = operator.attrgetter(facade)

    @functools.wraps(method)
    def forward(pool: BlockPool, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return method(get_facade(pool), *args, **kwargs)

    return forward


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

    The pool is composed of four façades over one shared core (:mod:`kvguard.pool_core`):
    request steps, block-level steps, the tier gate and fault recovery, each of which
    checks its arguments and calls the transition kernel. Their methods are the pool's.
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
        self._request_steps = RequestSteps(core)
        self._block_steps = BlockSteps(core)
        self._tier_gate = TierGate(core)
        self._recovery = Recovery(core)
        self._index_view = MappingProxyType(core.kernel.index)
        cls = type(self)
        for name, facade in _FACADE_OF.items():
            if getattr(cls, name) is getattr(BlockPool, name):  # (not a subclass's own)
                setattr(self, name, getattr(getattr(self, facade), name))
        if check_invariants:
            for name in _MUTATORS:
                setattr(self, name, self._checked(getattr(self, name)))

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

    # Request steps (kvguard.request_steps).
    add_request = _forwarded("_request_steps", RequestSteps.add_request)
    append_tokens = _forwarded("_request_steps", RequestSteps.append_tokens)
    append_block_hashes = _forwarded("_request_steps", RequestSteps.append_block_hashes)
    lookup = _forwarded("_request_steps", RequestSteps.lookup)
    can_allocate = _forwarded("_request_steps", RequestSteps.can_allocate)
    allocate = _forwarded("_request_steps", RequestSteps.allocate)
    write = _forwarded("_request_steps", RequestSteps.write)
    validate_step = _forwarded("_request_steps", RequestSteps.validate_step)
    fail_step = _forwarded("_request_steps", RequestSteps.fail_step)
    free = _forwarded("_request_steps", RequestSteps.free)
    block_table = _forwarded("_request_steps", RequestSteps.block_table)
    progress = _forwarded("_request_steps", RequestSteps.progress)

    @property
    def request_ids(self) -> tuple[str, ...]:
        """The open requests, in the order they were added."""
        return tuple(self._core.requests)

    # Fault recovery (kvguard.recovery).
    zero_request_tail = _forwarded("_recovery", Recovery.zero_request_tail)
    roll_back_blocks = _forwarded("_recovery", Recovery.roll_back_blocks)

    # Block-level steps (kvguard.block_steps).
    allocate_blocks = _forwarded("_block_steps", BlockSteps.allocate_blocks)
    acquire_blocks = _forwarded("_block_steps", BlockSteps.acquire_blocks)
    release_blocks = _forwarded("_block_steps", BlockSteps.release_blocks)
    write_blocks = _forwarded("_block_steps", BlockSteps.write_blocks)
    validate_blocks = _forwarded("_block_steps", BlockSteps.validate_blocks)
    fail_blocks = _forwarded("_block_steps", BlockSteps.fail_blocks)
    publish_block = _forwarded("_block_steps", BlockSteps.publish_block)
    disown_reference = _forwarded("_block_steps", BlockSteps.disown_reference)
    cached_block_id = _forwarded("_block_steps", BlockSteps.cached_block_id)

    # The tier gate (kvguard.tier_gate).
    storable_blocks = _forwarded("_tier_gate", TierGate.storable_blocks)
    begin_store = _forwarded("_tier_gate", TierGate.begin_store)
    ack_store = _forwarded("_tier_gate", TierGate.ack_store)
    fail_store = _forwarded("_tier_gate", TierGate.fail_store)
    forget_tier_copy = _forwarded("_tier_gate", TierGate.forget_tier_copy)
    tier_copies = _forwarded("_tier_gate", TierGate.tier_copies)
    invalidate = _forwarded("_tier_gate", TierGate.invalidate)

    def _checked(self, method: _F) -> _F:
        @functools.wraps(method)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            self.check_invariants()
            return result

        return wrapper  # type: ignore[return-value]

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
