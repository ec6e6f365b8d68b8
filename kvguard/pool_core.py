"""The state every part of the pool shares, and the machinery they all use.

Blocks, the free queue, the prefix index, the request records, the zero queue, the
event list and the counters live here, with the one writer of block states
(:meth:`PoolCore._move`) and the allocation/release paths every API shares. The
operations are grouped by concept in the mixins that :class:`kvguard.BlockPool`
combines: request steps, block-level steps, the tier gate, fault recovery.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvguard import arguments
from kvguard.block import Block
from kvguard.errors import (
    IllegalTransitionError,
    OutOfBlocksError,
    PoolMisuseError,
    RequestAbortedError,
    UnknownBlockError,
    UnknownRequestError,
)
from kvguard.events import BlockRemoved, PoolEvent
from kvguard.fast_path import fast_path
from kvguard.free_queue import FreeQueue
from kvguard.hashing import BlockHash, BlockHasher, default_block_hasher
from kvguard.ledger import RequestRecord
from kvguard.states import MATCHABLE_STATES, TRANSITIONS, BlockEvent, BlockState
from kvguard.stats import Counters
from kvguard.tiers import TierLedger
from kvguard.zeroing import ZeroPolicy, ZeroQueue

_FREE = BlockState.FREE
_ALLOCATED = BlockState.ALLOCATED
_WRITTEN = BlockState.WRITTEN
_VALIDATED = BlockState.VALIDATED
_PUBLISHED = BlockState.PUBLISHED
_OFFLOADED = BlockState.OFFLOADED
_QUARANTINED = BlockState.QUARANTINED

_ZERO_SUSPECT = ZeroPolicy.SUSPECT
_ZERO_ALL = ZeroPolicy.ALL

_ALLOCATE = BlockEvent.ALLOCATE
_WRITE = BlockEvent.WRITE
_VALIDATE = BlockEvent.VALIDATE
_PUBLISH = BlockEvent.PUBLISH
_ACQUIRE = BlockEvent.ACQUIRE
_RELEASE = BlockEvent.RELEASE
_EVICT = BlockEvent.EVICT
_FAIL = BlockEvent.FAIL

# Plain-dict views of the one transition table for the hot paths (no MappingProxy
# indirection); derived from TRANSITIONS, never edited by hand.
_NEXT: dict[BlockState, dict[BlockEvent, BlockState]] = {
    state: dict(row) for state, row in TRANSITIONS.items()
}
_RELEASE_TO: dict[BlockState, BlockState] = {
    state: row[_RELEASE] for state, row in _NEXT.items() if _RELEASE in row
}
_WRITE_TO = {state: row[_WRITE] for state, row in _NEXT.items() if _WRITE in row}
_ACQUIRE_TO = {state: row[_ACQUIRE] for state, row in _NEXT.items() if _ACQUIRE in row}
_EVICT_TO = {state: row[_EVICT] for state, row in _NEXT.items() if _EVICT in row}
# Transitions the hot paths apply inline; stop at import if the table ever disagrees.
if not (
    _NEXT[_FREE][_ALLOCATE] is _NEXT[_QUARANTINED][_ALLOCATE] is _ALLOCATED
    and _RELEASE_TO[_ALLOCATED] is _FREE
    and _RELEASE_TO[_NEXT[_WRITTEN][_VALIDATE]] is _FREE
):  # pragma: no cover - guards a future edit of TRANSITIONS
    raise ImportError(
        "kvguard.pool inlines ALLOCATE/VALIDATE/RELEASE transitions that TRANSITIONS changed"
    )
# The two single-source transitions of the validation path, read off the table.
_VALIDATE_FROM_WRITTEN = _NEXT[_WRITTEN][_VALIDATE]
_PUBLISH_FROM_VALIDATED = _NEXT[_VALIDATED][_PUBLISH]
# The block-level write of a freshly allocated block (write_blocks' fast path).
_WRITTEN_FROM_ALLOCATED = _NEXT[_ALLOCATED][_WRITE]
# Cached states a release leaves as they are (they become eviction candidates).
_STAYS_CACHED = frozenset(s for s in MATCHABLE_STATES if _RELEASE_TO.get(s) is s)
# Transitions the compiled release applies; stop at import if the table disagrees.
if not (
    _RELEASE_TO[_WRITTEN] is _QUARANTINED and _RELEASE_TO[_QUARANTINED] is _QUARANTINED
):  # pragma: no cover - guards a future edit of TRANSITIONS
    raise ImportError("kvguard's compiled release quarantines as TRANSITIONS no longer does")
# Matchable states a prefix hit (ACQUIRE) leaves as they are.
_ACQUIRABLE = tuple(s for s in MATCHABLE_STATES if _ACQUIRE_TO.get(s) is s)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PoolCore:
    """Shared state and machinery; see :class:`kvguard.BlockPool` for the API."""

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
        if type(num_blocks) is not int or num_blocks < 1:
            raise PoolMisuseError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if type(block_size) is not int or block_size < 1:
            raise PoolMisuseError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(zero_policy, ZeroPolicy):
            raise PoolMisuseError(f"zero_policy must be a ZeroPolicy, got {zero_policy!r}")
        if not (isinstance(block_type, type) and issubclass(block_type, Block)):
            raise PoolMisuseError(f"block_type must be a subclass of Block, got {block_type!r}")
        if not callable(hasher):
            raise PoolMisuseError(f"hasher must be callable, got {hasher!r}")
        arguments.flag("enable_caching", enable_caching)
        arguments.flag("record_events", record_events)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.zero_policy = zero_policy
        self._hasher = hasher
        # False: an engine that never drains take_events() (it builds its own) does not
        # pay for event objects on every publication and eviction.
        self.record_events = record_events
        self._blocks = [block_type(i) for i in range(num_blocks)]
        self._free = FreeQueue()
        self._free.push_all_empty(list(range(num_blocks)))
        self._index: dict[BlockHash, int] = {}
        # Hashes invalidated, and hashes of blocks chained on them, since last published
        # afresh: a publication whose parent is here descends from corrupt KV (see
        # TierGate.invalidate) and is refused.
        self._tainted: set[BlockHash] = set()
        self._requests: dict[str, RequestRecord] = {}
        self._zero = ZeroQueue()
        self._events: list[PoolEvent] = []
        self._tiers = TierLedger()
        self._counters = Counters()
        # The block-level hot paths in C when the extension was built (else None).
        self._fast = fast_path(
            block_type,
            self._blocks,
            self._free,
            self._index,
            allocated=_ALLOCATED,
            written_from_allocated=_WRITTEN_FROM_ALLOCATED,
            written=_WRITTEN,
            freed=_RELEASE_TO[_NEXT[_WRITTEN][_VALIDATE]],
            validated=_VALIDATE_FROM_WRITTEN,
            published=_PUBLISH_FROM_VALIDATED,
            quarantined=_RELEASE_TO[_WRITTEN],
            stays_cached=tuple(_STAYS_CACHED),
            acquirable=_ACQUIRABLE,
            evict_to=_EVICT_TO,
            counters=self._counters,
            zero_blocks=self._zero._blocks,  # the zero queue's own dict, filled in place
            tainted=self._tainted,
            zero_all=zero_policy is _ZERO_ALL,
            zero_suspect=zero_policy is _ZERO_SUSPECT,
        )

    def _move(self, block: Block, event: BlockEvent) -> None:
        """Apply ``event`` to ``block`` through the transition table (the only writer)."""
        new = _NEXT[block.state].get(event)
        if new is None:
            raise IllegalTransitionError(block.block_id, block.state, event)
        block.state = new

    def _quarantine(self, block: Block, event: BlockEvent) -> None:
        self._move(block, event)
        block.block_hash = None
        block.parent_hash = None
        block.generation += 1
        # Block-level steps: whatever was still in flight or waiting to be published
        # is void now (no-ops for request-level blocks, which never set them).
        block.writers = 0
        block.pending_publication = None
        self._counters.blocks_quarantined += 1

    def _chained_on_taint(self, block_hash: BlockHash, parent: BlockHash | None) -> bool:
        """The taint rule of every publication path, while any hash is tainted: a
        block chained on a tainted hash descends from corrupt KV, so it is refused
        (True) and its own hash is tainted too, unless a sound copy holds that hash;
        otherwise the block was computed afresh on a sound prefix, and its hash is
        sound again."""
        tainted = self._tainted
        if parent in tainted:
            if block_hash not in self._index:
                tainted.add(block_hash)
            self._counters.tainted_publications_refused += 1
            return True
        tainted.discard(block_hash)
        return False

    def _record(self, request_id: str) -> RequestRecord:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):  # TypeError: unhashable, not a str
            raise UnknownRequestError(arguments.request_id(request_id)) from None

    def _live_record(self, request_id: str) -> RequestRecord:
        rec = self._record(request_id)
        if rec.aborted:
            raise RequestAbortedError(
                f"request {request_id!r} was aborted by a failed step; free() it, or "
                "zero_request_tail() it to resume from its validated prefix"
            )
        return rec

    def _block(self, block_id: int) -> Block:
        if type(block_id) is not int or not 0 <= block_id < self.num_blocks:
            raise UnknownBlockError(
                f"block id {block_id!r} is outside this pool (0..{self.num_blocks - 1})"
            )
        return self._blocks[block_id]

    def _hash_blocks(self, rec: RequestRecord, n: int) -> list[BlockHash]:
        """Hash the request's first ``n`` blocks as far as its known token ids allow;
        returns its hash list (shorter than ``n`` while token ids are missing)."""
        hashes = rec.block_hashes
        if rec.explicit_hashes or len(hashes) >= n:
            return hashes
        size = self.block_size
        tokens = rec.token_ids
        hasher = self._hasher
        salt = rec.salt
        parent = hashes[-1] if hashes else None
        for j in range(len(hashes), min(n, len(tokens) // size)):
            parent = hasher(parent, tokens[j * size : (j + 1) * size], salt)
            hashes.append(parent)
        return hashes

    def _take_free(self, n: int, external_refs: int = 0, write: bool = False) -> list[int]:
        """Pop ``n`` blocks and hand them out, or raise :class:`OutOfBlocksError`
        having taken none. ``external_refs`` is 1 for block-level holders; ``write``
        hands them out WRITTEN by one block-level step (ALLOCATE then WRITE).

        Quarantined blocks go first (queued for zeroing under the ``suspect`` policy),
        then empty ones, then cached ones in eviction order (their hashes leave the
        index; one ``BlockRemoved`` event for the batch).
        """
        if n <= 0:
            return []
        free = self._free
        ids = free.take_empty(n)
        if ids is None:
            if n > free.size:
                raise OutOfBlocksError(n, free.size)
            ids, num_quarantined, num_evicted = free.take(n)
            if num_quarantined and self.zero_policy is _ZERO_SUSPECT:
                for block_id in ids[:num_quarantined]:
                    self._zero.add_block(block_id)
                self._counters.blocks_zeroed += num_quarantined
            if num_evicted:
                self._evict(ids[n - num_evicted :])
        # FREE/QUARANTINED --ALLOCATE--> ALLOCATED for every one of them, inlined (the
        # import-time check below the table views guarantees the table agrees).
        blocks = self._blocks
        state = _WRITTEN_FROM_ALLOCATED if write else _ALLOCATED
        writers = 1 if write else 0
        for block_id in ids:
            block = blocks[block_id]
            block.state = state
            block.ref_cnt = 1
            block.external_refs = external_refs
            block.writers = writers
            block.generation += 1
        if self.zero_policy is _ZERO_ALL:
            for block_id in ids:
                self._zero.add_block(block_id)
            self._counters.blocks_zeroed += n
        return ids

    def _evict(self, block_ids: list[int]) -> None:
        """Reclaim cached blocks the free queue gave up: EVICT, and drop their hashes."""
        blocks = self._blocks
        index = self._index
        hashes: list[BlockHash] = []
        for block_id in block_ids:
            block = blocks[block_id]
            new = _EVICT_TO.get(block.state)  # _move(block, EVICT), inlined
            if new is None:
                raise IllegalTransitionError(block_id, block.state, _EVICT)
            block.state = new
            block_hash = block.block_hash
            assert block_hash is not None, f"cached block {block_id} has no hash"
            del index[block_hash]
            hashes.append(block_hash)
            block.block_hash = None
            block.parent_hash = None
        self._counters.blocks_evicted += len(block_ids)
        if self.record_events:
            self._events.append(BlockRemoved(tuple(hashes), tuple(block_ids)))

    def _drop_last_refs(self, released: list[Block], retention: int | None) -> None:
        """Apply RELEASE to blocks whose last reference was just dropped and enqueue
        them, in ``released`` order (the first is evicted first).

        Unvalidated (WRITTEN) blocks are quarantined: their step can never be
        validated. ``retention`` (a request's) sets the eviction class of cached ones.
        """
        free = self._free
        empty: list[int] = []
        cached: list[Block] = []
        for block in released:
            state = block.state
            if state in _STAYS_CACHED:  # the common case: an evictable cached block
                if retention is not None:
                    block.retention = retention
                cached.append(block)
                continue
            # A publication still waiting for its step dies with the last holder.
            block.pending_publication = None
            if state is _WRITTEN:
                self._quarantine(block, _RELEASE)
                free.push(block)
                continue
            new = _RELEASE_TO.get(state)
            if new is None:
                raise IllegalTransitionError(block.block_id, state, _RELEASE)
            block.state = new
            if new is _FREE:
                block.block_hash = None
                block.parent_hash = None
                empty.append(block.block_id)
                continue
            if retention is not None:
                block.retention = retention
            if new is _QUARANTINED:
                free.push(block)
            else:
                cached.append(block)
        if empty:
            free.push_empty(empty)
        if cached:
            free.push_evictable(cached)

    def _acquire(self, block_ids: Sequence[int], external_refs: int) -> None:
        """Take a reference on cached blocks the caller checked are matchable."""
        blocks = self._blocks
        free = self._free
        for block_id in block_ids:
            block = blocks[block_id]
            if _ACQUIRE_TO.get(block.state) is not block.state:  # the table's self-loop
                raise IllegalTransitionError(block_id, block.state, _ACQUIRE)
            if not block.ref_cnt:
                free.remove_evictable(block)
            block.ref_cnt += 1
            block.external_refs += external_refs
