"""Request-level operations: admission, prefix hits, the write/validate ledger, release.

The engine names a request and a token count; the pool keeps the block table and the
ledger (see :mod:`kvguard.request_record`), publishes only what validated, and aborts a request
alone when one of its steps fails.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from kvguard import arguments
from kvguard.errors import (
    DuplicateRequestError,
    NoPendingStepError,
    NotAllocatedError,
    OutOfBlocksError,
    PoolMisuseError,
    RequestAbortedError,
    StaleHitError,
)
from kvguard.events import BlockStored, RequestAborted
from kvguard.hashing import BlockHash
from kvguard.pool_core import PoolCore, _cdiv
from kvguard.request_record import RequestRecord
from kvguard.results import PrefixHit, RequestProgress, StepOutcome, StepResult, TokenRange
from kvguard.states import MATCHABLE_STATES


class RequestSteps:
    """The request-level API: the engine names a request; the pool keeps its blocks
    and its write/validate ledger."""

    __slots__ = ("_block_size", "_core", "_kernel", "_requests")

    def __init__(self, core: PoolCore) -> None:
        self._core = core
        self._kernel = core.kernel
        self._requests = core.requests
        self._block_size = core.block_size

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
        arguments.request_id(request_id)
        if request_id in self._requests:
            raise DuplicateRequestError(
                f"request {request_id!r} is already open; free() it before adding it again"
            )
        if type(retention) is not int:
            retention = arguments.integer("retention", retention)
        if salt is not None and not isinstance(salt, bytes):
            raise PoolMisuseError(f"salt must be bytes or None, got {arguments.got(salt)}")
        tokens = arguments.token_array(token_ids)
        hashes = None if block_hashes is None else arguments.hash_list("block_hashes", block_hashes)
        rec = RequestRecord(
            request_id,
            tokens,
            salt,
            retention,
            explicit_hashes=hashes is not None,
            block_hashes=list(hashes) if hashes is not None else [],
            num_prompt_tokens=len(tokens),
        )
        self._requests[request_id] = rec
        self._kernel.counters.requests_added += 1

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> tuple[int, ...]:
        """Record token ids that became known (sampled outputs, the next prompt chunk).

        Validated full blocks that were waiting for their token ids to be hashed are
        published now; returns their ids.
        """
        rec = self._requests.get(request_id) if type(request_id) is str else None
        if rec is None:
            rec = self._core.record(request_id)  # raises UnknownRequestError
        rec.token_ids.extend(arguments.token_array(token_ids))
        return self._publish_ready(rec)

    def append_block_hashes(
        self, request_id: str, block_hashes: Sequence[BlockHash]
    ) -> tuple[int, ...]:
        """Extend a request opened with ``block_hashes``; publishes what became ready."""
        rec = self._core.record(request_id)
        if not rec.explicit_hashes:
            raise PoolMisuseError(
                f"request {request_id!r} was added without block_hashes=, so the pool hashes "
                "its token ids: use append_tokens()"
            )
        rec.block_hashes.extend(arguments.hash_list("block_hashes", block_hashes))
        return self._publish_ready(rec)

    def lookup(self, request_id: str, *, max_tokens: int | None = None) -> PrefixHit:
        """The longest prefix of the request whose blocks are PUBLISHED or OFFLOADED.

        Never returns a block whose KV is unvalidated. ``max_tokens`` caps the hit
        (a step computes at least one token, to produce the next token's logits: pass
        ``max_tokens=len(prompt) - 1`` to keep the last prompt token out of the hit, as
        vLLM does; a prompt hit whole leaves its first step nothing to write). Takes no
        reference: pass the hit to :meth:`allocate`, which refuses it if it went stale
        meanwhile.
        """
        rec = self._core.record(request_id)
        size = self._block_size
        limit = len(rec.block_hashes) * size if rec.explicit_hashes else len(rec.token_ids)
        if max_tokens is not None:
            limit = min(limit, arguments.count("max_tokens", max_tokens))
        ids: list[int] = []
        gens: list[int] = []
        kernel = self._kernel
        if kernel.enable_caching:
            index = kernel.index
            blocks = kernel.blocks
            for block_hash in self._hash_blocks(rec, limit // size)[: limit // size]:
                block_id = index.get(block_hash)
                if block_id is None:
                    break
                ids.append(block_id)
                gens.append(blocks[block_id].generation)
            if rec.explicit_hashes and len(set(ids)) != len(ids):
                # Caller-given hashes that repeat (chained ones never do) would name one
                # block twice in a block table: the hit ends before the first repeat.
                first_repeat = next(i for i, b in enumerate(ids) if b in ids[:i])
                del ids[first_repeat:], gens[first_repeat:]
        counters = kernel.counters
        counters.lookups += 1
        counters.lookup_query_tokens += limit
        counters.lookup_hit_tokens += len(ids) * size
        hit = rec.hit = PrefixHit(request_id, tuple(ids), tuple(gens), len(ids) * size)
        return hit

    def _hash_blocks(self, rec: RequestRecord, n: int) -> list[BlockHash]:
        """Hash the request's first ``n`` blocks as far as its known token ids allow;
        returns its hash list (shorter than ``n`` while token ids are missing)."""
        hashes = rec.block_hashes
        if rec.explicit_hashes or len(hashes) >= n:
            return hashes
        size = self._block_size
        tokens = rec.token_ids
        hasher = self._core.hasher
        salt = rec.salt
        parent = hashes[-1] if hashes else None
        for j in range(len(hashes), min(n, len(tokens) // size)):
            parent = hasher(parent, tokens[j * size : (j + 1) * size], salt)
            hashes.append(parent)
        return hashes

    def _check_hit(self, rec: RequestRecord, hit: object) -> PrefixHit:
        """The hit, if it is the one :meth:`lookup` last returned for this very request
        (not an earlier request under the same id, nor another pool's, nor a copy) and
        every block of it still holds what it held then; else a typed error."""
        if not isinstance(hit, PrefixHit):
            raise PoolMisuseError(
                f"hit must be the PrefixHit lookup() returned, or None; got {arguments.got(hit)}"
            )
        if hit.request_id != rec.request_id:
            raise StaleHitError(
                f"prefix hit belongs to request {hit.request_id!r}, not {rec.request_id!r}; "
                f"pass the hit lookup({rec.request_id!r}) returned"
            )
        if hit is not rec.hit:
            raise StaleHitError(
                f"this prefix hit is not the one lookup() last returned for request "
                f"{rec.request_id!r} as it is open now (an earlier request with that id, "
                "another pool's, a copy or built by hand); lookup() it again"
            )
        if rec.blocks:
            raise PoolMisuseError(
                f"request {rec.request_id!r} already holds blocks; a prefix hit is only "
                "used by its first allocation: allocate() without hit="
            )
        blocks = self._kernel.blocks
        for block_id, generation in zip(hit.block_ids, hit.generations, strict=True):
            block = blocks[block_id]
            if block.generation != generation or block.state not in MATCHABLE_STATES:
                raise StaleHitError(
                    f"block {block_id} of the prefix hit was evicted or invalidated since "
                    "lookup(); look the request up again"
                )
        return hit

    def can_allocate(
        self, request_id: str, num_tokens: int, *, hit: PrefixHit | None = None
    ) -> bool:
        """True if :meth:`allocate` with the same arguments would find enough blocks."""
        rec = self._core.record(request_id)
        if type(num_tokens) is not int or num_tokens < rec.num_written:
            num_tokens = self._check_total(rec, num_tokens)
        if hit is not None:
            hit = self._check_hit(rec, hit)
            self._check_hit_total(num_tokens, hit)
        return self._blocks_short(rec, num_tokens, hit) <= 0

    @staticmethod
    def _check_total(rec: RequestRecord, num_tokens: object) -> int:
        """``num_tokens`` of :meth:`allocate`, checked: the request's total, which is
        never below what it holds (written) already."""
        total = arguments.count("num_tokens", num_tokens)
        held = rec.num_written
        if total < held:
            raise PoolMisuseError(
                f"num_tokens={total} is below the {held} tokens request {rec.request_id!r} "
                "holds: allocate() takes the request's total token count, not a count of "
                f"new tokens; pass {held + 1} for one more token"
            )
        return total

    @staticmethod
    def _check_hit_total(num_tokens: int, hit: PrefixHit) -> None:
        if num_tokens < hit.num_tokens:
            raise PoolMisuseError(
                f"num_tokens={num_tokens} is below the prefix hit's {hit.num_tokens}: "
                "allocate() takes the request's total token count (hit included), e.g. "
                "len(prompt)"
            )

    def _blocks_short(self, rec: RequestRecord, num_tokens: int, hit: PrefixHit | None) -> int:
        """How many more blocks ``allocate`` needs than the free queue can give."""
        have = len(rec.blocks)
        pinned = 0
        if hit is not None:
            have += len(hit.block_ids)
            # A hit on an evictable block takes it out of the free queue.
            blocks = self._kernel.blocks
            pinned = sum(1 for b in hit.block_ids if blocks[b].ref_cnt == 0)
        need = _cdiv(num_tokens, self._block_size) - have
        return need - (self._kernel.free.size - pinned)

    def allocate(
        self, request_id: str, num_tokens: int, *, hit: PrefixHit | None = None
    ) -> tuple[int, ...]:
        """Grow the request's block table to hold ``num_tokens`` tokens in total.

        ``num_tokens`` is the request's total token count, not a count of new tokens:
        a request holding ``n`` written tokens makes room for one more with
        ``allocate(rid, n + 1)``; a total below ``n`` is refused.

        With ``hit`` (first allocation only), the hit's blocks are shared and their
        tokens count as written and validated. Returns the ids of newly allocated
        blocks; those that need zeroing are queued for ``take_blocks_to_zero``.
        Raises :class:`OutOfBlocksError` (changing nothing) when blocks run out.
        """
        rec = self._requests.get(request_id) if type(request_id) is str else None
        if rec is None or rec.aborted:
            rec = self._core.live_record(request_id)  # raises: unknown, or aborted
        if type(num_tokens) is not int or num_tokens < rec.num_written:
            num_tokens = self._check_total(rec, num_tokens)
        if hit is not None:
            hit = self._check_hit(rec, hit)
            self._check_hit_total(num_tokens, hit)
        elif -(-num_tokens // self._block_size) <= len(rec.blocks):
            return ()  # (most decode steps: the last block has room)
        short = self._blocks_short(rec, num_tokens, hit)
        if short > 0:
            need = _cdiv(num_tokens, self._block_size) - len(rec.blocks)
            raise OutOfBlocksError(need, need - short)
        kernel = self._kernel
        if hit is not None and hit.block_ids:
            kernel.acquire(list(hit.block_ids), False)
            rec.blocks.extend(hit.block_ids)
            rec.num_written = rec.num_validated = hit.num_tokens
            rec.publish_cursor = len(hit.block_ids)
        need = _cdiv(num_tokens, self._block_size) - len(rec.blocks)
        if need <= 0:  # (the hit covers the request)
            return ()
        new = kernel.allocate(need, False, False)
        rec.blocks.extend(new)
        return tuple(new)

    def write(self, request_id: str, num_tokens: int) -> TokenRange:
        """Record that a scheduled step writes the request's next ``num_tokens`` tokens.

        The blocks it touches become WRITTEN: not matchable, not storable, until
        :meth:`validate_step` confirms this step. Returns the step's token range.
        """
        rec = self._requests.get(request_id) if type(request_id) is str else None
        if rec is None or rec.aborted:
            rec = self._core.live_record(request_id)  # raises: unknown, or aborted
        if type(num_tokens) is not int or num_tokens < 1:
            num_tokens = self._check_step(rec, num_tokens)
        size = self._block_size
        start = rec.num_written
        end = start + num_tokens
        if end > len(rec.blocks) * size:
            raise NotAllocatedError(
                f"request {request_id!r} holds {len(rec.blocks)} blocks "
                f"({len(rec.blocks) * size} tokens) but the step writes up to token {end}: "
                f"allocate({request_id!r}, {end}) first (allocate() takes the request's "
                "total token count)"
            )
        kernel = self._kernel
        kernel.write(rec.blocks, start // size, (end - 1) // size)
        if kernel.enable_caching:
            # Blocks this step fills: vLLM (0.32 to 0.34) would publish them now, unvalidated.
            kernel.counters.deferred_publications += end // size - start // size
        rec.num_written = end
        rec.pending.append(end)
        return TokenRange(start, end)

    def _check_step(self, rec: RequestRecord, num_tokens: object) -> int:
        """``num_tokens`` of :meth:`write`, checked: at least one token."""
        count = arguments.count("num_tokens", num_tokens)
        if count:
            return count
        rid = rec.request_id
        hit = rec.hit
        prompt = rec.num_prompt_tokens
        if (
            hit is None
            or not hit.num_tokens
            or hit.num_tokens < prompt
            or rec.num_written != hit.num_tokens
            or not self._holds_hit(rec, hit)
        ):
            raise PoolMisuseError(
                f"write({rid!r}, 0): a step writes at least one token; call write() only "
                "for the requests a step computes tokens of"
            )
        if prompt:  # the hit covers the whole prompt
            raise PoolMisuseError(
                f"write({rid!r}, 0): a step writes at least one token, and the prefix hit "
                f"covers the whole prompt ({prompt} tokens), leaving none to compute the "
                "next token's logits from; keep the last prompt token out of the hit, as "
                f"vLLM does: lookup({rid!r}, max_tokens={prompt - 1}) (free() the request "
                "and add it again to start over)"
            )
        raise PoolMisuseError(
            f"write({rid!r}, 0): a step writes at least one token; the request holds the "
            f"{hit.num_tokens} tokens of its prefix hit and nothing since (if the hit "
            "covers the whole prompt, keep the last prompt token out of it, as vLLM does: "
            f"lookup({rid!r}, max_tokens=len(prompt) - 1))"
        )

    def _holds_hit(self, rec: RequestRecord, hit: PrefixHit) -> bool:
        """Whether the request's block table starts with the very blocks of ``hit``
        (its first allocation took the hit)."""
        n = len(hit.block_ids)
        blocks = self._kernel.blocks
        return tuple(rec.blocks[:n]) == hit.block_ids and all(
            blocks[b].generation == g for b, g in zip(hit.block_ids, hit.generations, strict=True)
        )

    def validate_step(self, request_id: str, seals: Mapping[int, int] | None = None) -> StepResult:
        """The request's oldest in-flight step passed: its blocks become VALIDATED, and
        full hashed ones PUBLISHED (a ``BlockStored`` event is emitted now).

        ``seals``: block id -> the seal of the block's KV the step's engine took
        (:func:`kvguard.kernels.seal_blocks`), recorded with each block this validation
        covers, as :meth:`BlockSteps.validate_blocks` does; a covered block without one
        keeps none."""
        if seals is not None:
            seals = arguments.seals(seals)
        rec = self._requests.get(request_id) if type(request_id) is str else None
        if rec is None or not rec.pending or rec.discarded or rec.aborted:
            rec, next_end = self._next_result(request_id, "validate")
            if next_end is None:
                return self._discard(rec)
            end = next_end
        else:
            end = rec.pending.popleft()  # (_next_result's common case)
        start = rec.num_validated
        rec.num_validated = end
        size = self._block_size
        written = rec.num_written
        kernel = self._kernel
        # Only blocks none of whose written tokens is still in flight: all the step
        # wrote into when no later step is in flight, else those it filled.
        last = (end - 1) // size if written <= end else end // size - 1
        kernel.validate(rec.blocks, start // size, last)
        if seals or self._core.seals:
            covered = rec.blocks[start // size : last + 1]
            self._core.record_seals(covered, covered, seals or {})
        kernel.counters.steps_validated += 1
        published = self._publish_ready(rec)
        return StepResult(
            request_id, StepOutcome.VALIDATED, TokenRange(start, end), end, published=published
        )

    def _publish_ready(self, rec: RequestRecord) -> tuple[int, ...]:
        """Publish the request's full, validated, hashable blocks, in prefix order."""
        size = self._block_size
        limit = rec.num_validated // size
        cursor = rec.publish_cursor
        if cursor >= limit:
            return ()
        hashes = self._hash_blocks(rec, limit)
        stop = min(limit, len(hashes))  # beyond: token ids not known yet
        if cursor >= stop:
            return ()
        kernel = self._kernel
        published, published_hashes, first_parent = kernel.publish_chain(
            rec.blocks[cursor:stop], hashes[cursor:stop], hashes[cursor - 1] if cursor else None
        )
        rec.publish_cursor = stop
        if not published:
            return ()
        ids = tuple(published)
        if kernel.record_events:
            kernel.events.append(
                BlockStored(rec.request_id, tuple(published_hashes), ids, first_parent)
            )
        return ids

    def _next_result(self, request_id: str, verb: str) -> tuple[RequestRecord, int | None]:
        """The request and the end of the step this result is for (its oldest in
        flight), taken off the ledger; None when the result is to be discarded (the
        step was in flight when the request aborted)."""
        rec = self._core.record(request_id)
        if rec.discarded:
            return rec, None
        if rec.aborted:
            raise RequestAbortedError(
                f"request {request_id!r} was aborted; no step of it is pending: free() it, "
                "or zero_request_tail() it to resume from its validated prefix"
            )
        if not rec.pending:
            raise NoPendingStepError(
                f"request {request_id!r} has no step in flight to {verb}; write() records one"
            )
        return rec, rec.pending.popleft()

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
        rec, end = self._next_result(request_id, "fail")
        if end is None:
            return self._discard(rec)
        tokens = TokenRange(rec.num_validated, end)
        kernel = self._kernel
        quarantined = kernel.fail(rec.blocks[rec.num_validated // self._block_size :])
        rec.discarded = rec.pending
        rec.pending = deque()
        rec.aborted = True
        counters = kernel.counters
        counters.steps_failed += 1
        counters.requests_aborted += 1
        ids = tuple(quarantined)
        if kernel.record_events:
            kernel.events.append(RequestAborted(request_id, rec.num_validated, ids))
        return StepResult(
            request_id, StepOutcome.FAILED, tokens, rec.num_validated, quarantined=ids
        )

    def free(self, request_id: str) -> None:
        """Release every block of the request (finished, aborted or preempted).

        Blocks whose step never got its result are quarantined; published blocks stay
        matchable as eviction candidates; the rest return to the free queue. Tail
        blocks are released first so that they are evicted before the shared prefix.
        """
        rec = self._core.pop_record(request_id)
        self._kernel.release_table(rec.blocks, rec.retention)

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """The request's block ids, in token order."""
        return tuple(self._core.record(request_id).blocks)

    def progress(self, request_id: str) -> RequestProgress:
        """Where the request's write/validate ledger stands."""
        rec = self._core.record(request_id)
        return RequestProgress(
            request_id,
            num_blocks=len(rec.blocks),
            num_written_tokens=rec.num_written,
            num_validated_tokens=rec.num_validated,
            num_pending_steps=len(rec.pending) + len(rec.discarded),
            aborted=rec.aborted,
        )
