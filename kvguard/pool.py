"""kvguard's block pool: KV is shared or offloaded only after the step that wrote it passed.

The pool is sans-IO: it never touches tensors. It keeps every block's state (see
:mod:`kvguard.states`), the prefix index, a per-request write/validate ledger, and three
queues the engine drains — blocks and token slots to zero (``take_blocks_to_zero``,
``take_slots_to_zero``) and events (``take_events``).

A request's life, as an engine drives it::

    pool.add_request("r1", prompt_token_ids)
    hit = pool.lookup("r1")                     # only PUBLISHED/OFFLOADED blocks
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
from array import array
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from kvguard.block import Block, BlockInfo
from kvguard.errors import (
    DoubleFreeError,
    DuplicateRequestError,
    ForeignBlockError,
    IllegalTransitionError,
    NoPendingStepError,
    NotAllocatedError,
    NotStorableError,
    OutOfBlocksError,
    PoolMisuseError,
    RequestAbortedError,
    RollbackError,
    StaleHitError,
    UnknownBlockError,
    UnknownRequestError,
    UnknownTicketError,
)
from kvguard.events import AllBlocksCleared, BlockRemoved, BlockStored, PoolEvent, RequestAborted
from kvguard.free_queue import FreeQueue
from kvguard.hashing import BlockHash, BlockHasher, default_block_hasher
from kvguard.invariants import PoolSnapshot, check_pool, take_snapshot
from kvguard.ledger import RequestRecord
from kvguard.results import (
    BlockValidation,
    InvalidationReport,
    PrefixHit,
    PublishOutcome,
    RequestProgress,
    SlotRange,
    StepOutcome,
    StepResult,
    StoreTicket,
    TailRollback,
    TokenRange,
)
from kvguard.states import MATCHABLE_STATES, STORABLE_STATES, TRANSITIONS, BlockEvent, BlockState
from kvguard.stats import Counters, PoolStats
from kvguard.tiers import TierLedger
from kvguard.zeroing import ZeroPolicy, ZeroQueue

_FREE = BlockState.FREE
_ALLOCATED = BlockState.ALLOCATED
_WRITTEN = BlockState.WRITTEN
_VALIDATED = BlockState.VALIDATED
_PUBLISHED = BlockState.PUBLISHED
_OFFLOADED = BlockState.OFFLOADED
_QUARANTINED = BlockState.QUARANTINED

_ALLOCATE = BlockEvent.ALLOCATE
_WRITE = BlockEvent.WRITE
_VALIDATE = BlockEvent.VALIDATE
_PUBLISH = BlockEvent.PUBLISH
_ACQUIRE = BlockEvent.ACQUIRE
_RELEASE = BlockEvent.RELEASE
_EVICT = BlockEvent.EVICT
_FAIL = BlockEvent.FAIL

CHECK_INVARIANTS_ENV = "KVGUARD_CHECK_INVARIANTS"

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
# Transitions the hot paths apply inline; stop at import if the table ever disagrees.
if not (
    _NEXT[_FREE][_ALLOCATE] is _NEXT[_QUARANTINED][_ALLOCATE] is _ALLOCATED
    and _RELEASE_TO[_ALLOCATED] is _FREE
):  # pragma: no cover - guards a future edit of TRANSITIONS
    raise ImportError("kvguard.pool inlines ALLOCATE/RELEASE transitions that TRANSITIONS changed")
# The two single-source transitions of the validation path, read off the table.
_VALIDATE_FROM_WRITTEN = _NEXT[_WRITTEN][_VALIDATE]
_PUBLISH_FROM_VALIDATED = _NEXT[_VALIDATED][_PUBLISH]
# The block-level write of a freshly allocated block (write_blocks' fast path).
_WRITTEN_FROM_ALLOCATED = _NEXT[_ALLOCATED][_WRITE]
# Cached states a release leaves as they are (they become eviction candidates).
_STAYS_CACHED = frozenset(s for s in MATCHABLE_STATES if _RELEASE_TO.get(s) is s)

_F = TypeVar("_F", bound=Callable[..., Any])

# Public methods that change the pool; wrapped with an invariant check when asked for.
_MUTATORS = (
    "add_request",
    "append_tokens",
    "append_block_hashes",
    "allocate",
    "write",
    "validate_step",
    "fail_step",
    "free",
    "zero_request_tail",
    "allocate_blocks",
    "acquire_blocks",
    "release_blocks",
    "write_blocks",
    "validate_blocks",
    "fail_blocks",
    "publish_block",
    "begin_store",
    "ack_store",
    "fail_store",
    "forget_tier_copy",
    "invalidate",
    "reset_prefix_cache",
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _token_array(token_ids: Iterable[int]) -> array[int]:
    """Token ids as a compact int64 array; bad ids fail here, not later mid-publication."""
    try:
        return array("q", token_ids)
    except (TypeError, OverflowError) as exc:
        raise PoolMisuseError(f"token ids must be ints in int64 range: {exc}") from None


def _check_count(name: str, value: int) -> None:
    if type(value) is not int or value < 0:
        raise PoolMisuseError(f"{name} must be a non-negative int, got {value!r}")


class BlockPool:
    """A validation-gated pool of ``num_blocks`` KV-cache blocks of ``block_size`` tokens.

    ``enable_caching`` turns the prefix index on (validated full blocks are published);
    ``zero_policy`` chooses which reused blocks the engine must zero (default: only
    suspect ones); ``hasher`` replaces the default chained BLAKE2b block hasher.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        zero_policy: ZeroPolicy = ZeroPolicy.SUSPECT,
        hasher: BlockHasher = default_block_hasher,
        check_invariants: bool | None = None,
    ) -> None:
        if type(num_blocks) is not int or num_blocks < 1:
            raise PoolMisuseError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if type(block_size) is not int or block_size < 1:
            raise PoolMisuseError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(zero_policy, ZeroPolicy):
            raise PoolMisuseError(f"zero_policy must be a ZeroPolicy, got {zero_policy!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.zero_policy = zero_policy
        self._hasher = hasher
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._free = FreeQueue()
        self._free.push_all_empty(list(range(num_blocks)))
        self._index: dict[BlockHash, int] = {}
        self._requests: dict[str, RequestRecord] = {}
        self._zero = ZeroQueue()
        self._events: list[PoolEvent] = []
        self._tiers = TierLedger()
        self._counters = Counters()
        if check_invariants is None:
            check_invariants = os.environ.get(CHECK_INVARIANTS_ENV, "") not in ("", "0")
        if check_invariants:
            for name in _MUTATORS:
                setattr(self, name, self._checked(getattr(self, name)))

    def _checked(self, method: _F) -> _F:
        @functools.wraps(method)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            self.check_invariants()
            return result

        return wrapper  # type: ignore[return-value]

    # ------------------------------------------------------------------ transitions

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

    # ------------------------------------------------------------------ lookups

    def _record(self, request_id: str) -> RequestRecord:
        try:
            return self._requests[request_id]
        except KeyError:
            raise UnknownRequestError(request_id) from None

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

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        token_ids: Sequence[int] = (),
        *,
        salt: bytes | None = None,
        block_hashes: Sequence[BlockHash] | None = None,
        retention: int = 0,
    ) -> None:
        """Open a request. Its prompt's ``token_ids`` are hashed block by block on demand.

        Engines that hash blocks themselves pass ``block_hashes`` (one per full block,
        chained) instead and extend them with :meth:`append_block_hashes`. A request's
        cached blocks are evicted in order of ``retention`` (lower first), LRU within.
        """
        if not isinstance(request_id, str):
            raise PoolMisuseError(f"request_id must be a str, got {request_id!r}")
        if request_id in self._requests:
            raise DuplicateRequestError(
                f"request {request_id!r} is already open; free() it before adding it again"
            )
        if type(retention) is not int:
            raise PoolMisuseError(f"retention must be an int, got {retention!r}")
        if salt is not None and not isinstance(salt, bytes):
            raise PoolMisuseError(f"salt must be bytes or None, got {salt!r}")
        tokens = _token_array(token_ids)
        rec = RequestRecord(
            request_id,
            tokens,
            salt,
            retention,
            explicit_hashes=block_hashes is not None,
            block_hashes=list(block_hashes) if block_hashes is not None else [],
            num_prompt_tokens=len(tokens),
        )
        self._requests[request_id] = rec
        self._counters.requests_added += 1

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> tuple[int, ...]:
        """Record token ids that became known (sampled outputs, the next prompt chunk).

        Validated full blocks that were waiting for their token ids to be hashed are
        published now; returns their ids.
        """
        rec = self._record(request_id)
        rec.token_ids.extend(_token_array(token_ids))
        return self._publish_ready(rec)

    def append_block_hashes(
        self, request_id: str, block_hashes: Sequence[BlockHash]
    ) -> tuple[int, ...]:
        """Extend a request opened with ``block_hashes``; publishes what became ready."""
        rec = self._record(request_id)
        if not rec.explicit_hashes:
            raise PoolMisuseError(
                f"request {request_id!r} hashes its token ids; use append_tokens()"
            )
        rec.block_hashes.extend(block_hashes)
        return self._publish_ready(rec)

    def lookup(self, request_id: str, *, max_tokens: int | None = None) -> PrefixHit:
        """The longest prefix of the request whose blocks are PUBLISHED or OFFLOADED.

        Never returns a block whose KV is unvalidated. ``max_tokens`` caps the hit
        (engines keep at least one prompt token to compute). Takes no reference: pass
        the hit to :meth:`allocate`, which refuses it if it went stale meanwhile.
        """
        rec = self._record(request_id)
        size = self.block_size
        limit = len(rec.block_hashes) * size if rec.explicit_hashes else len(rec.token_ids)
        if max_tokens is not None:
            _check_count("max_tokens", max_tokens)
            limit = min(limit, max_tokens)
        ids: list[int] = []
        gens: list[int] = []
        if self.enable_caching:
            index = self._index
            blocks = self._blocks
            for block_hash in self._hash_blocks(rec, limit // size)[: limit // size]:
                block_id = index.get(block_hash)
                if block_id is None:
                    break
                ids.append(block_id)
                gens.append(blocks[block_id].generation)
        counters = self._counters
        counters.lookups += 1
        counters.lookup_query_tokens += limit
        counters.lookup_hit_tokens += len(ids) * size
        return PrefixHit(request_id, tuple(ids), tuple(gens), len(ids) * size)

    def _check_hit(self, rec: RequestRecord, hit: PrefixHit) -> None:
        if hit.request_id != rec.request_id:
            raise PoolMisuseError(
                f"prefix hit belongs to request {hit.request_id!r}, not {rec.request_id!r}"
            )
        if rec.blocks:
            raise PoolMisuseError(
                f"request {rec.request_id!r} already holds blocks; a prefix hit is only "
                "used by its first allocation"
            )
        blocks = self._blocks
        for block_id, generation in zip(hit.block_ids, hit.generations, strict=True):
            block = blocks[block_id]
            if block.generation != generation or block.state not in MATCHABLE_STATES:
                raise StaleHitError(
                    f"block {block_id} of the prefix hit was evicted or invalidated since "
                    "lookup(); look the request up again"
                )

    def can_allocate(
        self, request_id: str, num_tokens: int, *, hit: PrefixHit | None = None
    ) -> bool:
        """True if :meth:`allocate` with the same arguments would find enough blocks."""
        rec = self._record(request_id)
        return self._blocks_short(rec, num_tokens, hit) <= 0

    def _blocks_short(self, rec: RequestRecord, num_tokens: int, hit: PrefixHit | None) -> int:
        """How many more blocks ``allocate`` needs than the free queue can give."""
        have = len(rec.blocks)
        pinned = 0
        if hit is not None:
            have += len(hit.block_ids)
            # A hit on an evictable block takes it out of the free queue.
            blocks = self._blocks
            pinned = sum(1 for b in hit.block_ids if blocks[b].ref_cnt == 0)
        need = _cdiv(num_tokens, self.block_size) - have
        return need - (len(self._free) - pinned)

    def allocate(
        self, request_id: str, num_tokens: int, *, hit: PrefixHit | None = None
    ) -> tuple[int, ...]:
        """Grow the request's block table to hold ``num_tokens`` tokens in total.

        With ``hit`` (first allocation only), the hit's blocks are shared and their
        tokens count as written and validated. Returns the ids of newly allocated
        blocks; those that need zeroing are queued for ``take_blocks_to_zero``.
        Raises :class:`OutOfBlocksError` (changing nothing) when blocks run out.
        """
        rec = self._live_record(request_id)
        _check_count("num_tokens", num_tokens)
        if hit is not None:
            self._check_hit(rec, hit)
            if num_tokens < hit.num_tokens:
                raise PoolMisuseError(
                    f"num_tokens={num_tokens} is below the prefix hit's {hit.num_tokens}"
                )
        short = self._blocks_short(rec, num_tokens, hit)
        if short > 0:
            need = _cdiv(num_tokens, self.block_size) - len(rec.blocks)
            raise OutOfBlocksError(need, need - short)
        if hit is not None and hit.block_ids:
            self._acquire(hit.block_ids, 0)
            rec.blocks.extend(hit.block_ids)
            rec.num_written = rec.num_validated = hit.num_tokens
            rec.publish_cursor = len(hit.block_ids)
        new = self._take_free(_cdiv(num_tokens, self.block_size) - len(rec.blocks))
        rec.blocks.extend(new)
        return tuple(new)

    def _take_free(self, n: int, external_refs: int = 0) -> list[int]:
        """Pop ``n`` blocks and hand them out, or raise :class:`OutOfBlocksError`
        having taken none. ``external_refs`` is 1 for block-level holders.

        Quarantined blocks go first (queued for zeroing under the ``suspect`` policy),
        then empty ones, then cached ones in eviction order (their hashes leave the
        index; one ``BlockRemoved`` event for the batch).
        """
        if n <= 0:
            return []
        free = self._free
        ids = free.take_empty(n)
        if ids is None:
            if n > len(free):
                raise OutOfBlocksError(n, len(free))
            quarantined, empty, evicted = free.take(n)
            if quarantined and self.zero_policy is ZeroPolicy.SUSPECT:
                for block_id in quarantined:
                    self._zero.add_block(block_id)
                self._counters.blocks_zeroed += len(quarantined)
            if evicted:
                self._evict(evicted)
            ids = quarantined + empty + evicted
        # FREE/QUARANTINED --ALLOCATE--> ALLOCATED for every one of them, inlined (the
        # import-time check below the table views guarantees the table agrees).
        blocks = self._blocks
        for block_id in ids:
            block = blocks[block_id]
            block.state = _ALLOCATED
            block.ref_cnt = 1
            block.external_refs = external_refs
            block.generation += 1
        if self.zero_policy is ZeroPolicy.ALL:
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
            self._move(block, _EVICT)
            block_hash = block.block_hash
            assert block_hash is not None, f"cached block {block_id} has no hash"
            del index[block_hash]
            hashes.append(block_hash)
            block.block_hash = None
            block.parent_hash = None
        self._counters.blocks_evicted += len(block_ids)
        self._events.append(BlockRemoved(tuple(hashes), tuple(block_ids)))

    def write(self, request_id: str, num_tokens: int) -> TokenRange:
        """Record that a scheduled step writes the request's next ``num_tokens`` tokens.

        The blocks it touches become WRITTEN: not matchable, not storable, until
        :meth:`validate_step` confirms this step. Returns the step's token range.
        """
        rec = self._live_record(request_id)
        _check_count("num_tokens", num_tokens)
        if num_tokens == 0:
            raise PoolMisuseError("a step writes at least one token (num_tokens=0)")
        size = self.block_size
        start = rec.num_written
        end = start + num_tokens
        if end > len(rec.blocks) * size:
            raise NotAllocatedError(
                f"request {request_id!r} holds {len(rec.blocks)} blocks "
                f"({len(rec.blocks) * size} tokens) but the step writes up to token {end}; "
                "allocate() first"
            )
        blocks = self._blocks
        table = rec.blocks
        first = start // size
        last = (end - 1) // size
        for i in range(first, last + 1):
            block = blocks[table[i]]
            state = block.state
            if state is not _WRITTEN:
                # _move(block, WRITE), inlined: this runs for every block of a prompt.
                new = _WRITE_TO.get(state)
                if new is None:
                    raise IllegalTransitionError(block.block_id, state, _WRITE)
                block.state = new
        if self.enable_caching:
            # Blocks this step fills: vLLM 0.33 would publish them now, unvalidated.
            self._counters.withheld_publications += end // size - start // size
        rec.num_written = end
        rec.pending.append(end)
        return TokenRange(start, end)

    def validate_step(self, request_id: str) -> StepResult:
        """The request's oldest in-flight step passed: its blocks become VALIDATED, and
        full hashed ones PUBLISHED (a ``BlockStored`` event is emitted now)."""
        rec = self._record(request_id)
        if rec.discarded:
            return self._discard(rec)
        if rec.aborted:
            raise RequestAbortedError(f"request {request_id!r} was aborted; no step is pending")
        if not rec.pending:
            raise NoPendingStepError(
                f"request {request_id!r} has no step in flight to validate; write() records one"
            )
        end = rec.pending.popleft()
        start = rec.num_validated
        rec.num_validated = end
        size = self.block_size
        written = rec.num_written
        blocks = self._blocks
        table = rec.blocks
        for i in range(start // size, (end - 1) // size + 1):
            block = blocks[table[i]]
            # Only blocks none of whose written tokens is still in flight.
            if block.state is _WRITTEN and min((i + 1) * size, written) <= end:
                block.state = _VALIDATE_FROM_WRITTEN  # _move(block, VALIDATE), inlined
        self._counters.steps_validated += 1
        published = self._publish_ready(rec)
        return StepResult(
            request_id, StepOutcome.VALIDATED, TokenRange(start, end), end, published=published
        )

    def _publish_ready(self, rec: RequestRecord) -> tuple[int, ...]:
        """Publish the request's full, validated, hashable blocks, in prefix order."""
        size = self.block_size
        limit = rec.num_validated // size
        cursor = rec.publish_cursor
        if cursor >= limit:
            return ()
        hashes = self._hash_blocks(rec, limit)
        stop = min(limit, len(hashes))  # beyond: token ids not known yet
        blocks = self._blocks
        table = rec.blocks
        index = self._index
        caching = self.enable_caching
        published_ids: list[int] = []
        published_hashes: list[BlockHash] = []
        first_parent: BlockHash | None = None
        for i in range(cursor, stop):
            block = blocks[table[i]]
            if block.state is not _VALIDATED:
                continue  # a prefix hit (already published) or tainted meanwhile
            block_hash = hashes[i]
            parent = hashes[i - 1] if i else None
            block.block_hash = block_hash
            block.parent_hash = parent
            if caching and block_hash not in index:
                block.state = _PUBLISH_FROM_VALIDATED  # _move(block, PUBLISH), inlined
                index[block_hash] = block.block_id
                if not published_ids:
                    first_parent = parent
                published_ids.append(block.block_id)
                published_hashes.append(block_hash)
        rec.publish_cursor = stop
        if not published_ids:
            return ()
        n = len(published_ids)
        self._counters.blocks_published += n
        ids = tuple(published_ids)
        self._events.append(BlockStored(rec.request_id, tuple(published_hashes), ids, first_parent))
        return ids

    def _discard(self, rec: RequestRecord) -> StepResult:
        end = rec.discarded.popleft()
        return StepResult(
            rec.request_id, StepOutcome.DISCARDED, TokenRange(end, end), rec.num_validated
        )

    def fail_step(self, request_id: str) -> StepResult:
        """The request's oldest in-flight step failed validation: abort the request alone.

        Every block holding a token past the validated boundary is QUARANTINED (never
        published, never stored, zeroed before reuse); the validated prefix keeps its
        state. Results of the request's later in-flight steps are discarded when they
        arrive. Free the request (or roll it back with :meth:`zero_request_tail`).
        """
        rec = self._record(request_id)
        if rec.discarded:
            return self._discard(rec)
        if rec.aborted:
            raise RequestAbortedError(f"request {request_id!r} was aborted; no step is pending")
        if not rec.pending:
            raise NoPendingStepError(
                f"request {request_id!r} has no step in flight to fail; write() records one"
            )
        end = rec.pending.popleft()
        tokens = TokenRange(rec.num_validated, end)
        blocks = self._blocks
        quarantined: list[int] = []
        for block_id in rec.blocks[rec.num_validated // self.block_size :]:
            block = blocks[block_id]
            if block.state is _WRITTEN:
                self._quarantine(block, _FAIL)
                quarantined.append(block_id)
        rec.discarded = rec.pending
        rec.pending = deque()
        rec.aborted = True
        counters = self._counters
        counters.steps_failed += 1
        counters.requests_aborted += 1
        ids = tuple(quarantined)
        self._events.append(RequestAborted(request_id, rec.num_validated, ids))
        return StepResult(
            request_id, StepOutcome.FAILED, tokens, rec.num_validated, quarantined=ids
        )

    def free(self, request_id: str) -> None:
        """Release every block of the request (finished, aborted or preempted).

        Blocks whose step never got its result are quarantined; published blocks stay
        matchable as eviction candidates; the rest return to the free queue. Tail
        blocks are released first so that they are evicted before the shared prefix.
        """
        rec = self._record(request_id)
        del self._requests[request_id]
        blocks = self._blocks
        retention = rec.retention
        cached: list[int] = []
        released: list[Block] = []
        for block_id in reversed(rec.blocks):
            block = blocks[block_id]
            ref = block.ref_cnt - 1
            block.ref_cnt = ref
            if ref:
                continue
            if block.state in _STAYS_CACHED:  # the common case, kept inline
                block.retention = retention
                cached.append(block_id)
            else:
                released.append(block)
        if cached:
            self._free.push_evictable_ids(retention, cached)
        if released:
            self._drop_last_refs(released, retention)

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

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """The request's block ids, in token order."""
        return tuple(self._record(request_id).blocks)

    def progress(self, request_id: str) -> RequestProgress:
        """Where the request's write/validate ledger stands."""
        rec = self._record(request_id)
        return RequestProgress(
            request_id,
            num_blocks=len(rec.blocks),
            num_written_tokens=rec.num_written,
            num_validated_tokens=rec.num_validated,
            num_pending_steps=len(rec.pending) + len(rec.discarded),
            aborted=rec.aborted,
        )

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(self._requests)

    # ------------------------------------------------------------------ fault recovery

    def zero_request_tail(self, request_id: str, num_tokens: int | None = None) -> TailRollback:
        """Roll the request back so it can resume from its surviving KV.

        By default everything past the validated boundary is dropped; ``num_tokens``
        drops exactly the last ``num_tokens`` written tokens instead. The dropped token
        slots are queued, at token granularity, for ``take_slots_to_zero`` (a partial
        block keeps its valid prefix). The request's in-flight steps past the new
        boundary are forgotten: their results must not be delivered. A request aborted
        by a failed step is revived. Published (shared) blocks are never rolled back.
        """
        rec = self._record(request_id)
        old = rec.num_written
        if num_tokens is None:
            boundary = rec.num_validated
        else:
            _check_count("num_tokens", num_tokens)
            if num_tokens > old:
                raise PoolMisuseError(
                    f"cannot roll back {num_tokens} tokens: request {request_id!r} has "
                    f"written only {old}"
                )
            boundary = old - num_tokens
            if rec.aborted and boundary > rec.num_validated:
                raise RollbackError(
                    f"request {request_id!r} was aborted: tokens past its validated boundary "
                    f"({rec.num_validated}) come from the failed step and cannot be kept"
                )
        size = self.block_size
        blocks = self._blocks
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
        if affected and boundary % size:
            first = blocks[table[affected[0]]]
            if first.state is _QUARANTINED and (affected[0] + 1) * size <= rec.num_validated:
                # Quarantined though wholly validated: its hash was tainted (invalidate),
                # so the prefix this rollback would keep is corrupt too.
                raise RollbackError(
                    f"block {first.block_id} of request {request_id!r} was invalidated; "
                    f"roll back to its start (token {affected[0] * size}) or free the request"
                )
        new_validated = min(rec.num_validated, boundary)
        slots: list[SlotRange] = []
        for i in affected:
            block = blocks[table[i]]
            lo = max(boundary, i * size) - i * size
            hi = min(old, (i + 1) * size) - i * size
            slots.append(SlotRange(block.block_id, lo, hi))
            self._move(block, BlockEvent.ROLLBACK)
            block.block_hash = None
            block.parent_hash = None
            block.generation += 1
            # Replay the ledger for the tokens this block keeps (at most the first one).
            if lo:
                self._move(block, _WRITE)
                if i * size + lo <= new_validated:
                    self._move(block, _VALIDATE)
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
        del rec.token_ids[max(boundary + 1, rec.num_prompt_tokens) :]
        if not rec.explicit_hashes:
            del rec.block_hashes[len(rec.token_ids) // size :]
        result = TailRollback(request_id, boundary, old - boundary, tuple(slots))
        self._zero.add_slots(result.slots)
        self._counters.slots_zeroed += old - boundary
        return result

    # ------------------------------------------------------------------ block-level API

    def allocate_blocks(self, num_blocks: int) -> list[int]:
        """Hand out ``num_blocks`` blocks to a caller that keeps its own block tables.

        Block-level holders (vLLM-style managers) release them with
        :meth:`release_blocks`; the write/validate ledger is per request and does not
        apply to them, so they never become matchable.
        """
        if type(num_blocks) is not int or num_blocks < 0:
            _check_count("num_blocks", num_blocks)
        return self._take_free(num_blocks, 1)

    def acquire_blocks(self, block_ids: Iterable[int]) -> None:
        """Take a block-level reference on cached (PUBLISHED/OFFLOADED) blocks."""
        ids = list(block_ids)
        for block_id in ids:
            block = self._block(block_id)
            if block.state not in MATCHABLE_STATES:
                raise IllegalTransitionError(block_id, block.state, _ACQUIRE)
        self._acquire(ids, 1)

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

    def release_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop block-level references taken by allocate_blocks/acquire_blocks.

        Blocks whose last reference goes are enqueued in the given order (the first
        is evicted first); a block still being written by a block-level step is
        quarantined (its step can never be validated now).
        """
        ids = block_ids if isinstance(block_ids, list) else list(block_ids)
        blocks = self._blocks
        num_blocks = self.num_blocks
        targets: list[Block] = []
        if len(ids) == 1 or len(set(ids)) == len(ids):
            for block_id in ids:
                if type(block_id) is not int or not 0 <= block_id < num_blocks:
                    self._block(block_id)  # raises UnknownBlockError
                block = blocks[block_id]
                if not block.external_refs or not block.ref_cnt:
                    self._check_release(block, 1)  # raises
                targets.append(block)
        else:
            wanted: dict[int, int] = {}
            for block_id in ids:
                wanted[block_id] = wanted.get(block_id, 0) + 1
            for block_id, n in wanted.items():
                self._check_release(self._block(block_id), n)
            targets = [blocks[block_id] for block_id in ids]
        released: list[Block] = []
        empty: list[int] = []
        for block in targets:
            block.external_refs -= 1
            ref = block.ref_cnt - 1
            block.ref_cnt = ref
            if ref:
                continue
            if block.state is _ALLOCATED:
                # Never written: ALLOCATED --RELEASE--> FREE, inlined (the common case).
                block.state = _FREE
                empty.append(block.block_id)
            else:
                released.append(block)
        if empty:
            self._free.push_empty(empty)
        if released:
            self._drop_last_refs(released, None)

    @staticmethod
    def _check_release(block: Block, n: int) -> None:
        if block.ref_cnt == 0:
            raise DoubleFreeError(f"block {block.block_id} has no reference left to release")
        if n > block.external_refs:
            raise ForeignBlockError(
                f"block {block.block_id} is held by a request's block table, not through "
                "allocate_blocks()/acquire_blocks(); free() the request instead"
            )

    # ------------------------------------------------------------------ block-level steps
    #
    # The write/validate ledger for holders that keep their own block tables (vLLM's
    # KVCacheManager): they name the blocks a scheduled step writes instead of a
    # request's token range. A block counts its in-flight writers, so under async
    # scheduling a block written by steps N and N+1 validates only when both did.

    def write_blocks(self, block_ids: Iterable[int]) -> None:
        """A scheduled step writes into these block-level-held blocks.

        They become WRITTEN (not matchable, not storable) until every step writing
        them passed :meth:`validate_blocks`. A validated block that is written again
        loses any hash it carried: its bytes change.

        Runtime: one pass when every block is ALLOCATED (blocks just handed out, the
        common case for a holder that marks blocks written when it allocates them).
        """
        ids = block_ids if isinstance(block_ids, list) else list(block_ids)
        blocks = self._blocks
        num_blocks = self.num_blocks
        checked: list[Block] = []
        fast = True
        for block_id in ids:
            if type(block_id) is not int or not 0 <= block_id < num_blocks:
                self._block(block_id)  # raises UnknownBlockError
            block = blocks[block_id]
            if block.external_refs == 0:
                raise ForeignBlockError(
                    f"block {block_id} is not held through allocate_blocks()/"
                    "acquire_blocks(); request-level blocks are written with write()"
                )
            state = block.state
            if state is not _ALLOCATED:
                fast = False
                if state is not _WRITTEN and state is not _VALIDATED:
                    raise IllegalTransitionError(block_id, state, _WRITE)
            checked.append(block)
        if fast and len(set(ids)) == len(ids):
            # ALLOCATED --WRITE--> WRITTEN for all of them, inlined (an
            # ALLOCATED block carries no hash).
            for block in checked:
                block.state = _WRITTEN_FROM_ALLOCATED
                block.writers = 1
            return
        for block in checked:
            if block.state is not _WRITTEN:
                if block.block_hash is not None:
                    block.block_hash = None
                    block.parent_hash = None
                    block.generation += 1
                self._move(block, _WRITE)
            block.writers += 1

    def validate_blocks(self, block_ids: Iterable[int]) -> BlockValidation:
        """The step that wrote these blocks passed (each id once per step).

        A block no other in-flight step writes becomes VALIDATED, and its deferred
        publication (:meth:`publish_block`) happens now.

        Runtime: one checking pass and one applying pass over the ids; one result
        object per call (callers batch a whole step's blocks into one call).
        """
        ids = block_ids if isinstance(block_ids, list) else list(block_ids)
        blocks = self._blocks
        num_blocks = self.num_blocks
        for block_id in ids:
            if type(block_id) is not int or not 0 <= block_id < num_blocks:
                self._block(block_id)  # raises UnknownBlockError
            block = blocks[block_id]
            if block.state is not _WRITTEN or not block.writers:
                self._no_pending_step(block, 1)
        if len(set(ids)) != len(ids):
            wanted: dict[int, int] = {}
            for block_id in ids:
                wanted[block_id] = wanted.get(block_id, 0) + 1
            for block_id, n in wanted.items():
                if blocks[block_id].writers < n:
                    self._no_pending_step(blocks[block_id], n)
        validated: list[int] = []
        published: list[int] = []
        duplicates: list[int] = []
        for block_id in ids:
            block = blocks[block_id]
            block.writers -= 1
            if block.writers:
                continue
            # WRITTEN --VALIDATE--> VALIDATED, inlined.
            block.state = _VALIDATE_FROM_WRITTEN
            validated.append(block_id)
            pending = block.pending_publication
            if pending is not None:
                block.pending_publication = None
                if self._publish_one(block, *pending):
                    published.append(block_id)
                else:
                    duplicates.append(block_id)
        return BlockValidation(tuple(validated), tuple(published), tuple(duplicates))

    @staticmethod
    def _no_pending_step(block: Block, n: int) -> None:
        raise NoPendingStepError(
            f"block {block.block_id} is {block.state.name} with {block.writers} step(s) "
            f"in flight, cannot validate {n}; was it released or failed meanwhile?"
        )

    def fail_blocks(self, block_ids: Iterable[int]) -> tuple[int, ...]:
        """A step that wrote these blocks failed (or can never be validated).

        Every WRITTEN block among them is QUARANTINED: never published, never stored,
        zeroed before reuse. Validated and published blocks keep their state (rule 5).
        Returns the quarantined ids.
        """
        ids = [self._block(block_id).block_id for block_id in block_ids]
        blocks = self._blocks
        out: list[int] = []
        for block_id in ids:
            block = blocks[block_id]
            if block.state is _WRITTEN:
                self._quarantine(block, _FAIL)
                out.append(block_id)
        return tuple(out)

    def publish_block(
        self,
        block_id: int,
        block_hash: BlockHash,
        parent_hash: BlockHash | None = None,
        *,
        owner: str = "",
    ) -> PublishOutcome:
        """Ask for a full block-level-held block to enter the prefix index.

        The deferred-publication hook: vLLM 0.33 caches full blocks while the step
        that fills them is being *scheduled*; here a block still being written is
        only marked, and published by the :meth:`validate_blocks` call that
        validates it (``BlockStored`` is emitted then, naming ``owner``). A
        quarantined block is refused with :class:`IllegalTransitionError`.
        """
        if not self.enable_caching:
            raise PoolMisuseError("publish_block() needs a pool with enable_caching=True")
        block = self._block(block_id)
        state = block.state
        if state in MATCHABLE_STATES:
            if block.block_hash != block_hash:
                raise PoolMisuseError(f"block {block_id} is already published under another hash")
            return PublishOutcome.PUBLISHED
        if state is _VALIDATED:
            if self._publish_one(block, block_hash, parent_hash, owner):
                return PublishOutcome.PUBLISHED
            return PublishOutcome.DUPLICATE
        if state in (_ALLOCATED, _WRITTEN) and block.ref_cnt:
            block.pending_publication = (block_hash, parent_hash, owner)
            self._counters.withheld_publications += 1
            return PublishOutcome.DEFERRED
        raise IllegalTransitionError(block_id, state, _PUBLISH)

    def _publish_one(
        self, block: Block, block_hash: BlockHash, parent_hash: BlockHash | None, owner: str
    ) -> bool:
        """Publish a VALIDATED block; False if its hash is indexed already (duplicate)."""
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        if block_hash in self._index:
            return False
        self._move(block, _PUBLISH)
        self._index[block_hash] = block.block_id
        self._counters.blocks_published += 1
        self._events.append(BlockStored(owner, (block_hash,), (block.block_id,), parent_hash))
        return True

    def cached_block_id(self, block_hash: BlockHash) -> int | None:
        """The PUBLISHED/OFFLOADED block holding ``block_hash``, or None (no reference
        is taken: :meth:`acquire_blocks` it)."""
        return self._index.get(block_hash)

    # ------------------------------------------------------------------ tier gate

    def storable_blocks(self, request_id: str, tier: str = "default") -> tuple[int, ...]:
        """The request's blocks that may be copied to ``tier`` now: validated, full,
        hashed, and not already stored or being stored there."""
        rec = self._record(request_id)
        blocks = self._blocks
        holds = self._tiers.holds
        out: list[int] = []
        for block_id in rec.blocks:
            block = blocks[block_id]
            if block.state not in STORABLE_STATES or block.block_hash is None:
                continue
            if not holds(block.block_hash, tier):
                out.append(block_id)
        return tuple(out)

    def begin_store(self, block_id: int, tier: str = "default") -> StoreTicket:
        """Start copying a validated block to ``tier``; raises unless VALIDATED or later."""
        block = self._block(block_id)
        if block.state not in STORABLE_STATES or block.block_hash is None:
            raise NotStorableError(
                f"block {block_id} is {block.state.name}"
                + ("" if block.block_hash is not None else " without a hash")
                + "; only validated, full, hashed blocks may be stored to a tier"
            )
        self._counters.stores_started += 1
        return self._tiers.issue(block_id, block.block_hash, block.generation, tier)

    def _retire(self, ticket: StoreTicket) -> None:
        if self._tiers.tickets.get(ticket.ticket_id) != ticket:
            raise UnknownTicketError(
                f"store ticket {ticket.ticket_id} is not in flight (acknowledged or failed "
                "already, or issued by another pool)"
            )
        self._tiers.retire(ticket)

    def ack_store(self, ticket: StoreTicket) -> bool:
        """A tier acknowledged its copy. Returns True if registered (PUBLISHED blocks
        become OFFLOADED); False if the block was quarantined, invalidated or reused
        meanwhile — the tier must then discard the copy."""
        self._retire(ticket)
        block = self._blocks[ticket.block_id]
        if (
            block.generation != ticket.generation
            or block.block_hash != ticket.block_hash
            or block.state not in STORABLE_STATES
        ):
            self._counters.dropped_acks += 1
            return False
        self._move(block, BlockEvent.STORE_ACK)
        self._tiers.add_copy(ticket.block_hash, block.parent_hash, ticket.tier)
        self._counters.stores_acknowledged += 1
        return True

    def fail_store(self, ticket: StoreTicket) -> None:
        """A tier reported that its copy failed; the block may be offered again."""
        self._retire(ticket)
        self._counters.stores_failed += 1

    def forget_tier_copy(self, tier: str, block_hash: BlockHash) -> bool:
        """A tier evicted its copy on its own; returns False if it held none."""
        return self._tiers.drop_copy(block_hash, tier)

    def tier_copies(self, block_hash: BlockHash) -> tuple[str, ...]:
        """Tiers holding an acknowledged copy of ``block_hash``."""
        return tuple(sorted(self._tiers.copies.get(block_hash, ())))

    def invalidate(
        self, block_hashes: Iterable[BlockHash], *, descendants: bool = True
    ) -> InvalidationReport:
        """Taint hashes found corrupt after the fact.

        Every GPU block carrying one leaves the prefix index and is QUARANTINED; every
        tier copy is reported for purging. With ``descendants`` (default) blocks chained
        after a tainted one are tainted too: their KV was computed attending to it.
        """
        targets = dict.fromkeys(block_hashes)
        blocks = self._blocks
        if descendants:
            children: dict[BlockHash, list[BlockHash]] = {}
            for block in blocks:
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
        dropped: list[int] = []
        removed_hashes: list[BlockHash] = []
        removed_ids: list[int] = []
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is None or block_hash not in targets:
                continue
            if block.state in MATCHABLE_STATES:
                del self._index[block_hash]
                removed_hashes.append(block_hash)
                removed_ids.append(block.block_id)
                if block.ref_cnt == 0:
                    self._free.remove_evictable(block)
            self._quarantine(block, BlockEvent.INVALIDATE)
            if block.ref_cnt == 0:
                self._free.push(block)
            dropped.append(block.block_id)
        tier_copies = [
            (tier, block_hash) for block_hash in targets for tier in self._tiers.purge(block_hash)
        ]
        dropped_set = set(dropped)
        requests = tuple(
            rid for rid, rec in self._requests.items() if dropped_set.intersection(rec.blocks)
        )
        if removed_ids:
            self._events.append(BlockRemoved(tuple(removed_hashes), tuple(removed_ids)))
        self._counters.hashes_invalidated += len(targets)
        return InvalidationReport(tuple(targets), tuple(dropped), tuple(tier_copies), requests)

    # ------------------------------------------------------------------ cache control

    def reset_prefix_cache(self, *, keep_held: Iterable[int] = ()) -> bool:
        """Drop every cached block from the index; only when no block is held.

        Returns False (changing nothing) while any block has a reference, as vLLM does.
        Blocks in ``keep_held`` may stay referenced (a holder's permanent placeholder,
        such as vLLM's null block); they must not be cached.
        """
        kept = set(keep_held)
        if any(block.ref_cnt for block in self._blocks if block.block_id not in kept):
            return False
        if any(self._block(b).state in MATCHABLE_STATES for b in kept):
            raise PoolMisuseError("keep_held names a cached block; release it first")
        blocks = self._blocks
        for block_id in self._free.clear_evictable():
            block = blocks[block_id]
            self._move(block, _EVICT)
            block.block_hash = None
            block.parent_hash = None
            self._free.push(block)
        self._index.clear()
        self._events.append(AllBlocksCleared())
        return True

    # ------------------------------------------------------------------ drains

    def take_blocks_to_zero(self) -> list[int]:
        """Block ids the engine must zero (every layer) before its next step runs."""
        return self._zero.take_blocks()

    def take_slots_to_zero(self) -> list[SlotRange]:
        """Token slots the engine must wipe (every layer) before its next step runs."""
        return self._zero.take_slots()

    def take_events(self) -> list[PoolEvent]:
        """Events since the last call, oldest first."""
        events = self._events
        self._events = []
        return events

    # ------------------------------------------------------------------ observation

    def block_info(self, block_id: int) -> BlockInfo:
        return BlockInfo.of(self._block(block_id))

    def block_state(self, block_id: int) -> BlockState:
        """The block's state alone (no snapshot object: for per-step hot paths)."""
        return self._block(block_id).state

    def get_num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free, quarantined and evictable)."""
        return len(self._free)

    def stats(self) -> PoolStats:
        return PoolStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            blocks_by_state=self._blocks_by_state(),
            num_free=len(self._free),
            num_evictable=self._free.num_evictable,
            num_requests=len(self._requests),
            zero_queue_blocks=len(self._zero.pending_blocks()),
            zero_queue_slots=len(self._zero.pending_slots()),
            stores_in_flight=len(self._tiers.tickets),
            counters=dataclasses.replace(self._counters),
        )

    def _blocks_by_state(self) -> dict[BlockState, int]:
        """Counted by walking the blocks: O(num_blocks), paid by stats() callers only,
        so that no transition on the hot paths has to keep a tally."""
        counts = dict.fromkeys(BlockState, 0)
        for state, n in Counter(block.state for block in self._blocks).items():
            counts[state] = n
        return counts

    def check_invariants(self) -> None:
        """Walk the whole pool; raise :class:`InvariantViolation` describing what broke."""
        check_pool(self)

    def snapshot(self) -> PoolSnapshot:
        """Everything observable about the pool, as one comparable value."""
        return take_snapshot(self)
