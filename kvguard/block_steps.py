"""Block-level operations, for engines that keep their own block tables (vLLM).

The caller names blocks instead of a request: allocate/acquire/release references, and
the block-level write/validate ledger with deferred publication. Each method checks its
arguments and calls one primitive of the transition kernel
(:mod:`kvguard.transition_kernel`), which changes the blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvguard import arguments
from kvguard.block import PendingPublication
from kvguard.errors import PoolMisuseError, UnknownBlockError
from kvguard.hashing import BlockHash
from kvguard.pool_core import PoolCore
from kvguard.results import BlockValidation, PublishOutcome
from kvguard.states import MATCHABLE_STATES


class BlockSteps:
    """The block-level API: the caller keeps its own block tables and names blocks."""

    __slots__ = ("_core", "_kernel")

    def __init__(self, core: PoolCore) -> None:
        self._core = core
        self._kernel = core.kernel

    @staticmethod
    def _ids(block_ids: Iterable[int]) -> list[int]:
        """``block_ids`` as a list (the kernel's primitives refuse ids outside the
        pool: their compiled twins check them on the way)."""
        return block_ids if type(block_ids) is list else arguments.id_list(block_ids)

    def _checked_ids(self, block_ids: list[int]) -> list[int]:
        """After a primitive refused ``block_ids`` (:class:`UnknownBlockError`, having
        changed nothing): a new list of them as ints, to call it again with, or the
        error naming the first id that is not an int in range. Integer-likes (numpy
        integers) are converted here, off the hot path: the primitives take ints."""
        return arguments.block_ids(block_ids, self._core.num_blocks)

    def allocate_blocks(self, num_blocks: int, *, write: bool = False) -> list[int]:
        """Hand out ``num_blocks`` blocks to a caller that keeps its own block tables.

        Block-level holders (vLLM-style managers) release them with
        :meth:`release_blocks`; the write/validate ledger is per request and does not
        apply to them, so they never become matchable.

        ``write=True`` is ``allocate_blocks`` followed by :meth:`write_blocks` on the
        blocks handed out, in one call: they come back WRITTEN by one step.
        """
        if type(num_blocks) is not int or num_blocks < 0:
            num_blocks = arguments.count("num_blocks", num_blocks)
        if write is not False and write is not True:
            arguments.flag("write", write)
        return self._kernel.allocate(num_blocks, True, write)

    def acquire_blocks(self, block_ids: Iterable[int]) -> None:
        """Take a block-level reference on cached (PUBLISHED/OFFLOADED) blocks."""
        ids = self._ids(block_ids)
        try:
            self._kernel.acquire(ids, True)
        except UnknownBlockError:
            self._kernel.acquire(self._checked_ids(ids), True)

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
        if steps_passed is not False and steps_passed is not True:
            arguments.flag("steps_passed", steps_passed)
        ids = self._ids(block_ids)
        try:
            self._kernel.release_held(ids, steps_passed)
        except UnknownBlockError:
            self._kernel.release_held(self._checked_ids(ids), steps_passed)

    def evict_first(self, block_ids: Iterable[int]) -> None:
        """A lower tier holds copies of these blocks: those queued as cached
        (PUBLISHED/OFFLOADED, no reference) are evicted before the other cached blocks
        of their retention class, the first named first -- vLLM's
        ``free_blocks(..., evict_first=True)``, after which a lazy CPU offloader walks
        the free queue from its head. Quarantined and empty blocks are still handed out
        before any cached one; ids not queued as cached are left where they are. Only
        the order changes: no block changes state, so nothing becomes storable or
        matchable that was not."""
        ids = self._ids(block_ids)
        try:
            self._kernel.check_ids(ids)
        except UnknownBlockError:
            ids = self._checked_ids(ids)
        self._kernel.evict_first(ids)

    def write_blocks(self, block_ids: Iterable[int]) -> None:
        """A scheduled step writes into these block-level-held blocks.

        They become WRITTEN (not matchable, not storable) until every step writing
        them passed :meth:`validate_blocks`. A validated block that is written again
        loses any hash it carried: its bytes change.
        """
        ids = self._ids(block_ids)
        try:
            self._kernel.write_held(ids)
        except UnknownBlockError:
            self._kernel.write_held(self._checked_ids(ids))

    def validate_blocks(
        self,
        block_ids: Iterable[int],
        publish: Mapping[int, PendingPublication] | None = None,
        seals: Mapping[int, int] | None = None,
    ) -> BlockValidation:
        """The step that wrote these blocks passed (each id once per step).

        A block no other in-flight step writes becomes VALIDATED, and its deferred
        publication happens now: the one :meth:`publish_block` recorded, or the one
        ``publish`` gives for its id -- ``(hash, parent hash, owner)`` that the caller
        held back until this result, exactly as if it had called ``publish_block``
        before this call (entries for ids not validated here are ignored). Both count
        as deferred publications.

        ``seals``: block id -> the seal the step's workers took of the block's KV
        (:func:`kvguard.kernels.seal_blocks`), recorded with each block that becomes
        VALIDATED here: its tier copies carry it (:attr:`StoreTicket.seal`), and a load
        of one is verified against it. A block this call names without a seal (or does
        not validate: another step still writes it) keeps none.

        Runtime: one checking pass and one applying pass over the ids; one result
        object per call (callers batch a whole step's blocks into one call).
        """
        ids = self._ids(block_ids)
        if seals is not None:
            seals = arguments.seals(seals)
        if publish is not None and (type(publish) is not dict or publish):
            publish = arguments.publications(publish)
            if publish and not self._kernel.enable_caching:
                raise PoolMisuseError(
                    "validate_blocks(publish=...) needs a pool with enable_caching=True; "
                    "leave publish out on this pool"
                )
        try:
            validated, published, duplicates = self._kernel.validate_held(ids, publish)
        except UnknownBlockError:
            ids = self._checked_ids(ids)
            validated, published, duplicates = self._kernel.validate_held(ids, publish)
        if seals or self._core.seals:
            self._core.record_seals(ids, validated, seals or {})
        return BlockValidation(tuple(validated), tuple(published), tuple(duplicates))

    def fail_blocks(self, block_ids: Iterable[int]) -> tuple[int, ...]:
        """A step that wrote these blocks failed (or can never be validated).

        Every WRITTEN block among them is QUARANTINED: never published, never stored,
        zeroed before reuse. Validated and published blocks keep their state (rule 5).
        Returns the quarantined ids.
        """
        ids = arguments.id_list(block_ids)
        for value in ids:
            if type(value) is not int or not 0 <= value < self._core.num_blocks:
                ids = self._checked_ids(ids)  # raises UnknownBlockError, or converts
                break
        kernel = self._kernel
        for block_id in ids:
            kernel.check_block_level(block_id)
        return tuple(kernel.fail(ids))

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
        if not self._kernel.enable_caching:
            raise PoolMisuseError(
                "publish_block() needs a pool with enable_caching=True; this pool never publishes"
            )
        if type(block_id) is not int or not 0 <= block_id < self._core.num_blocks:
            block_id = self._core.block(block_id).block_id  # raises UnknownBlockError
        publication = (block_hash, parent_hash, owner)
        arguments.publication(block_id, publication)
        return self._kernel.publish_held(block_id, publication)

    def disown_reference(self, block_id: int) -> None:
        """Take back one reference an engine counted on ``block_id`` by writing the
        record's ``ref_cnt`` itself (an engine whose blocks are kvguard's records,
        ``block_type``: vLLM's copy-on-write keeps both ends of a copy that way until
        the copy ran), so that the count is kvguard's references only and a block
        being written keeps one owner. The engine's matching release must not reach
        :meth:`release_blocks`. Raises :class:`PoolMisuseError`, changing nothing,
        when the block is not held through :meth:`allocate_blocks` alone (shared
        cached blocks and request tables' blocks are refused) or its count holds no
        reference beyond its block-level ones."""
        block = self._core.block(block_id)  # raises UnknownBlockError
        if (
            block.state in MATCHABLE_STATES
            or not block.external_refs
            or block.ref_cnt <= block.external_refs
        ):
            raise PoolMisuseError(
                f"disown_reference({block.block_id}): only a block held through "
                "allocate_blocks() alone, whose ref_cnt the engine raised beyond its "
                f"block-level references, has one to disown ({block.state.name}, "
                f"ref_cnt={block.ref_cnt}, block-level {block.external_refs})"
            )
        self._kernel.disown(block.block_id)

    def cached_block_id(self, block_hash: BlockHash) -> int | None:
        """The PUBLISHED/OFFLOADED block holding ``block_hash``, or None (no reference
        is taken: :meth:`acquire_blocks` it)."""
        return self._kernel.index.get(arguments.block_hash("block_hash", block_hash))
