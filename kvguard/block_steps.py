"""Block-level operations, for engines that keep their own block tables (vLLM).

The caller names blocks instead of a request: allocate/acquire/release references, and
the block-level write/validate ledger with deferred publication.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvguard import arguments
from kvguard.block import Block, PendingPublication
from kvguard.errors import (
    DoubleFreeError,
    ForeignBlockError,
    IllegalTransitionError,
    NoPendingStepError,
    PoolMisuseError,
)
from kvguard.events import BlockStored
from kvguard.hashing import BlockHash
from kvguard.pool_core import (
    _ACQUIRE,
    _ALLOCATED,
    _FAIL,
    _FREE,
    _PUBLISH,
    _PUBLISH_FROM_VALIDATED,
    _STAYS_CACHED,
    _VALIDATE_FROM_WRITTEN,
    _VALIDATED,
    _WRITE,
    _WRITTEN,
    _WRITTEN_FROM_ALLOCATED,
    PoolCore,
)
from kvguard.results import BlockValidation, PublishOutcome
from kvguard.states import MATCHABLE_STATES


def _nothing_held(block_id: int) -> None:
    return None


class BlockSteps(PoolCore):
    """The block-level API: the caller keeps its own block tables and names blocks."""

    def allocate_blocks(self, num_blocks: int, *, write: bool = False) -> list[int]:
        """Hand out ``num_blocks`` blocks to a caller that keeps its own block tables.

        Block-level holders (vLLM-style managers) release them with
        :meth:`release_blocks`; the write/validate ledger is per request and does not
        apply to them, so they never become matchable.

        ``write=True`` is ``allocate_blocks`` followed by :meth:`write_blocks` on the
        blocks handed out, in one call: they come back WRITTEN by one step.
        """
        if type(num_blocks) is not int or num_blocks < 0:
            arguments.count("num_blocks", num_blocks)
        if write is not False and write is not True:
            arguments.flag("write", write)
        fast = self._fast
        if fast is not None:
            ids = fast.allocate(num_blocks, write, self._events if self.record_events else None)
            if ids is not None:
                return ids
        # write: ALLOCATED --WRITE--> WRITTEN for fresh, distinct, block-level-held
        # blocks (write_blocks' fast path, applied as they are handed out).
        return self._take_free(num_blocks, 1, write)

    def acquire_blocks(self, block_ids: Iterable[int]) -> None:
        """Take a block-level reference on cached (PUBLISHED/OFFLOADED) blocks."""
        ids = block_ids if type(block_ids) is list else arguments.id_list(block_ids)
        fast = self._fast
        if fast is not None and fast.acquire(ids):
            return
        blocks = self._blocks
        num_blocks = self.num_blocks
        for block_id in ids:
            if type(block_id) is not int or not 0 <= block_id < num_blocks:
                self._block(block_id)  # raises UnknownBlockError
            state = blocks[block_id].state
            if state not in MATCHABLE_STATES:
                raise IllegalTransitionError(block_id, state, _ACQUIRE)
        self._acquire(ids, 1)

    def release_blocks(self, block_ids: Iterable[int], *, steps_passed: bool = False) -> None:
        """Drop block-level references taken by allocate_blocks/acquire_blocks.

        Blocks whose last reference goes are enqueued in the given order (the first
        is evicted first); a block still being written by a block-level step is
        quarantined (its step can never be validated now).

        ``steps_passed=True``: the caller vouches that every step still writing these
        blocks passed (a holder leaving after a clean last step, with none in
        flight). Such blocks are validated as :meth:`validate_blocks` would (a
        pending publication happens), then released -- a holder's partial tail is
        freed, not quarantined, without a validation call of its own.
        """
        ids = block_ids if type(block_ids) is list else arguments.id_list(block_ids)
        if steps_passed is not False and steps_passed is not True:
            arguments.flag("steps_passed", steps_passed)
        fast = self._fast
        if fast is not None:
            left = fast.release(ids, steps_passed)
            if left is not None:  # (freed and cached blocks are enqueued already)
                if left:
                    self._settle_released(left, steps_passed)
                return
        blocks = self._blocks
        num_blocks = self.num_blocks
        # One pass drops the references, stopping at the first one that cannot be
        # dropped; then the drops are undone and the checking path names the error.
        # Blocks whose last reference goes: cached (they stay, evictable), freed
        # (never written, or written by steps that passed and publishing nothing:
        # they become FREE), any other state (_drop_last_refs decides).
        cached: list[Block] = []
        freed: list[Block] = []
        released: list[Block] = []
        done = 0
        for block_id in ids:
            if type(block_id) is not int or not 0 <= block_id < num_blocks:
                break
            block = blocks[block_id]
            refs = block.external_refs
            if not refs:  # (external references are counted in ref_cnt too)
                break
            block.external_refs = refs - 1
            ref = block.ref_cnt - 1
            block.ref_cnt = ref
            done += 1
            if not ref:
                state = block.state
                if state in _STAYS_CACHED:
                    cached.append(block)
                elif state is _ALLOCATED or (
                    steps_passed and state is _WRITTEN and block.pending_publication is None
                ):
                    freed.append(block)
                else:
                    released.append(block)
        if done != len(ids):
            for block_id in ids[:done]:
                block = blocks[block_id]
                block.external_refs += 1
                block.ref_cnt += 1
            self._raise_release_error(ids)
        if freed:
            # ALLOCATED --RELEASE--> FREE, and WRITTEN --VALIDATE--> VALIDATED
            # --RELEASE--> FREE, inlined (import-time checks in pool_core).
            free_ids = []
            for block in freed:
                block.state = _FREE
                block.writers = 0
                block.pending_publication = None  # dies with the last holder
                free_ids.append(block.block_id)
            self._free.push_empty(free_ids)
        if cached:
            self._free.push_evictable(cached)  # RELEASE keeps them cached (a self-loop)
        if released:
            self._settle_released(released, steps_passed)

    def _settle_released(self, released: list[Block], steps_passed: bool) -> None:
        """The end of :meth:`release_blocks` for blocks whose last reference went that
        neither stay cached nor are plainly freed."""
        if steps_passed:
            # Passed, with a publication waiting: validated and published first.
            # (Exclusive states: a WRITTEN block's only reference was just dropped.)
            written = [block.block_id for block in released if block.state is _WRITTEN]
            if written:
                self._validate_and_publish(written, None)
        self._drop_last_refs(released, None)

    def _count_ids(self, ids: list[int]) -> dict[int, int]:
        """How often each id is named; raises UnknownBlockError for one outside the pool."""
        wanted: dict[int, int] = {}
        for block_id in ids:
            self._block(block_id)  # raises UnknownBlockError
            wanted[block_id] = wanted.get(block_id, 0) + 1
        return wanted

    def _raise_release_error(self, ids: list[int]) -> None:
        """Why ``release_blocks(ids)`` cannot drop every reference (it raises)."""
        for block_id, n in self._count_ids(ids).items():
            self._check_release(self._blocks[block_id], n)
        raise AssertionError("release_blocks() stopped on a releasable block")  # pragma: no cover

    @staticmethod
    def _check_release(block: Block, n: int) -> None:
        if block.ref_cnt == 0:
            raise DoubleFreeError(f"block {block.block_id} has no reference left to release")
        if n > block.external_refs:
            raise ForeignBlockError(
                f"block {block.block_id} is held by a request's block table, not through "
                "allocate_blocks()/acquire_blocks(); free() the request instead"
            )

    def write_blocks(self, block_ids: Iterable[int]) -> None:
        """A scheduled step writes into these block-level-held blocks.

        They become WRITTEN (not matchable, not storable) until every step writing
        them passed :meth:`validate_blocks`. A validated block that is written again
        loses any hash it carried: its bytes change.

        Runtime: one pass when every block is ALLOCATED (blocks just handed out, the
        common case for a holder that marks blocks written when it allocates them).
        """
        ids = block_ids if type(block_ids) is list else arguments.id_list(block_ids)
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

    def validate_blocks(
        self,
        block_ids: Iterable[int],
        publish: Mapping[int, PendingPublication] | None = None,
    ) -> BlockValidation:
        """The step that wrote these blocks passed (each id once per step).

        A block no other in-flight step writes becomes VALIDATED, and its deferred
        publication happens now: the one :meth:`publish_block` recorded, or the one
        ``publish`` gives for its id -- ``(hash, parent hash, owner)`` that the caller
        held back until this result, exactly as if it had called ``publish_block``
        before this call (entries for ids not validated here are ignored). Both count
        as withheld publications.

        Runtime: one checking pass and one applying pass over the ids; one result
        object per call (callers batch a whole step's blocks into one call).
        """
        ids = block_ids if type(block_ids) is list else arguments.id_list(block_ids)
        if publish is not None and (type(publish) is not dict or publish):
            arguments.publications(publish)
            if publish and not self.enable_caching:
                raise PoolMisuseError("validate_blocks(publish=...) needs enable_caching=True")
        fast = self._fast
        if fast is not None and not self.record_events:
            # The usual case (distinct blocks, each written by this step alone), in C.
            applied = fast.validate(ids, publish if publish else None)  # type: ignore[arg-type]
            if applied is not None:
                published, duplicates, num_held = applied
                if num_held:
                    self._counters.withheld_publications += num_held
                if published:
                    self._counters.blocks_published += len(published)
                return BlockValidation(tuple(ids), tuple(published), tuple(duplicates))
        blocks = self._blocks
        num_blocks = self.num_blocks
        # The usual case -- distinct blocks, each written by this step alone: one
        # checking pass, then one applying pass.
        for block_id in ids:
            if type(block_id) is not int or not 0 <= block_id < num_blocks:
                break
            block = blocks[block_id]
            if block.state is not _WRITTEN or block.writers != 1:
                break
        else:
            if len(set(ids)) == len(ids):
                return self._validate_and_publish(ids, publish)
        # One pass counts the validations off the writers, stopping at the first
        # block with no step left to validate; then the counts are restored and the
        # checking path names the error.
        finished: list[Block] = []
        done = 0
        for block_id in ids:
            if type(block_id) is not int or not 0 <= block_id < num_blocks:
                break
            block = blocks[block_id]
            writers = block.writers
            if block.state is not _WRITTEN or not writers:
                break
            block.writers = writers - 1
            done += 1
            if writers == 1:
                finished.append(block)
        if done != len(ids):
            for block_id in ids[:done]:
                blocks[block_id].writers += 1
            self._raise_validate_error(ids)
        if publish and len(finished) != len(ids):
            # Blocks another in-flight step still writes: their publication waits for
            # that step, as publish_block's would.
            for block_id in ids:
                block = blocks[block_id]
                if block.writers and block_id in publish:
                    block.pending_publication = publish[block_id]
        return self._validate_and_publish([block.block_id for block in finished], publish)

    def _validate_and_publish(
        self, ids: list[int], publish: Mapping[int, PendingPublication] | None
    ) -> BlockValidation:
        """Make these blocks VALIDATED -- distinct blocks whose last writer passed, or
        that are VALIDATED already; the caller checked -- and carry out each one's
        publication: the one ``publish`` holds for it, else the one
        :meth:`publish_block` recorded. The one publication path of the pool's
        block-level API, and one pass: the per-step hot path of an engine (vLLM's
        adapter validates and publishes a whole step here)."""
        blocks = self._blocks
        index = self._index
        tainted = self._tainted
        events = self._events if self.record_events else None
        held = publish.get if publish else _nothing_held
        published: list[int] = []
        duplicates: list[int] = []
        num_held = 0
        for block_id in ids:
            block = blocks[block_id]
            block.writers = 0
            block.state = _VALIDATE_FROM_WRITTEN  # WRITTEN --VALIDATE--> VALIDATED
            pending = held(block_id)
            if pending is None:
                pending = block.pending_publication
                if pending is None:
                    continue
            else:
                num_held += 1
            block.pending_publication = None
            block_hash, parent_hash, owner = pending
            if tainted and self._chained_on_taint(block_hash, parent_hash):
                continue  # never published, never hashed (not storable either)
            block.block_hash = block_hash
            block.parent_hash = parent_hash
            if block_hash in index:
                duplicates.append(block_id)  # stays VALIDATED, hashed (storable)
                continue
            block.state = _PUBLISH_FROM_VALIDATED  # VALIDATED --PUBLISH--> PUBLISHED
            index[block_hash] = block_id
            published.append(block_id)
            if events is not None:
                events.append(BlockStored(owner, (block_hash,), (block_id,), parent_hash))
        if num_held:
            self._counters.withheld_publications += num_held
        if published:
            self._counters.blocks_published += len(published)
        return BlockValidation(tuple(ids), tuple(published), tuple(duplicates))

    def _raise_validate_error(self, ids: list[int]) -> None:
        """Why ``validate_blocks(ids)`` cannot validate every block (it raises)."""
        for block_id, n in self._count_ids(ids).items():
            block = self._blocks[block_id]
            if block.state is not _WRITTEN or block.writers < n:
                self._check_block_level(block)
                self._no_pending_step(block, n)
        raise AssertionError("validate_blocks() stopped on a valid block")  # pragma: no cover

    @staticmethod
    def _check_block_level(block: Block) -> None:
        """Refuse a block-level call on a block a request's block table holds (and no
        block-level holder shares: only cached blocks are shared)."""
        if block.ref_cnt and not block.external_refs and block.state not in MATCHABLE_STATES:
            raise ForeignBlockError(
                f"block {block.block_id} ({block.state.name}) is held by a request's block "
                "table, not through allocate_blocks(); use the request-level API for it"
            )

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
        ids = arguments.id_list(block_ids)
        for block_id in ids:
            self._check_block_level(self._block(block_id))
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
        if type(block_id) is not int or not 0 <= block_id < self.num_blocks:
            self._block(block_id)  # raises UnknownBlockError
        arguments.publication(block_id, (block_hash, parent_hash, owner))
        block = self._blocks[block_id]
        state = block.state
        if state in MATCHABLE_STATES:
            if block.block_hash != block_hash:
                raise PoolMisuseError(f"block {block_id} is already published under another hash")
            return PublishOutcome.PUBLISHED
        self._check_block_level(block)
        if state is _VALIDATED:
            block.pending_publication = (block_hash, parent_hash, owner)
            if self._validate_and_publish([block_id], None).published:
                return PublishOutcome.PUBLISHED
            return PublishOutcome.DUPLICATE
        if state in (_ALLOCATED, _WRITTEN) and block.ref_cnt:
            block.pending_publication = (block_hash, parent_hash, owner)
            self._counters.withheld_publications += 1
            return PublishOutcome.DEFERRED
        raise IllegalTransitionError(block_id, state, _PUBLISH)

    def cached_block_id(self, block_hash: BlockHash) -> int | None:
        """The PUBLISHED/OFFLOADED block holding ``block_hash``, or None (no reference
        is taken: :meth:`acquire_blocks` it)."""
        return self._index.get(arguments.block_hash("block_hash", block_hash))
