"""``GuardedBlockPool``: vLLM's ``BlockPool`` interface, kvguard's pool underneath.

vLLM's ``KVCacheCoordinator``, ``SingleTypeKVCacheManager``s and ``KVCacheManager``
call this object exactly as they call ``vllm.v1.core.block_pool.BlockPool`` (it is a
subclass, so every attribute vLLM or a connector reads exists). It is always guarded:
with the guard off, vLLM keeps its own pool (:func:`~kvguard.adapters.vllm.pool.manager.
install_guarded_pool` is not called; the guarded schedulers build vLLM's own scheduler).

A :class:`kvguard.BlockPool` owns every block's state, the free queue (quarantined
blocks first), the prefix index and the zero queue. The block objects vLLM's managers
hold are kvguard's own block records
(:class:`~kvguard.adapters.vllm.pool.kv_block.GuardedKVCacheBlock`): the ``ref_cnt`` and
``block_hash`` vLLM reads are kvguard's, written once, never a mirrored copy.
``cache_full_blocks`` no longer inserts at schedule time: it holds back the publication
each block vLLM caches is due (hash, parent, owner: :attr:`GuardedBlockPool.pending`)
and puts the blocks in the pool's outbox, which whoever drives the pool takes
(:meth:`GuardedBlockPool.take_cached`, like ``take_blocks_to_zero``): the guarded
scheduler, into the record of the step that fills them. :meth:`validate_fills` hands
the blocks to kvguard once that step is clean, and kvguard validates and publishes them
under their held publications in one call. The pool never calls into its driver's
records. How a release goes is said
in the call: ``free_blocks(blocks, steps_passed=True)`` for the blocks of a request
that leaves after a clean step (vLLM's own calls leave it False: unvalidated blocks are
quarantined).

Supported KV cache groups: full attention (MHA, GQA, MLA), sliding window, chunked
local and R-SWA (the guarded scheduler validates the blocks a window, local chunk or
R-SWA gap frees, see docs/vllm-reference.md), cross-attention and circular buffers (never
published: freed plainly after a clean step, else quarantined), and Mamba / gated-delta-
net state (its boundary checkpoints held back like attention blocks), with partial-block
prefix hits (``hash_block_size < block_size``: entries inside a block wait until nothing
changes what they cover, :meth:`GuardedBlockPool.cache_partial_block`).
Static sink and HiSparse groups are refused at install time
(:data:`~kvguard.adapters.vllm.pool.manager.REFUSED_MANAGERS`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kvguard.adapters.vllm._compat import (
    block_stored_lookahead,
    event_extra_keys,
    owning_pool,
    pool_handle,
    require_supported_vllm,
)

if TYPE_CHECKING:
    from kvguard._speedups import FillNotes

require_supported_vllm()

from vllm.distributed.kv_events import BlockRemoved  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    BlockHashWithGroupId,
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    maybe_convert_block_hash,
    resolve_block_hashes,
)

from kvguard.adapters.vllm.config import GuardConfig, GuardConfigError  # noqa: E402
from kvguard.adapters.vllm.exits.gate import group_suffix  # noqa: E402
from kvguard.adapters.vllm.exits.tier_purge import TierPurgeReport, TierPurgers  # noqa: E402
from kvguard.adapters.vllm.pool.kv_block import GuardedKVCacheBlock  # noqa: E402
from kvguard.block import PendingPublication  # noqa: E402
from kvguard.errors import (  # noqa: E402
    ConsistencyError,
    IllegalTransitionError,
    OutOfBlocksError,
    PoolMisuseError,
)
from kvguard.events import BlockRemoved as CoreBlockRemoved  # noqa: E402
from kvguard.fast_path import fill_notes  # noqa: E402
from kvguard.hashing import BlockHash  # noqa: E402
from kvguard.pool import BlockPool as KvGuardPool  # noqa: E402
from kvguard.results import BlockValidation  # noqa: E402
from kvguard.states import MATCHABLE_STATES, BlockState  # noqa: E402

_WRITTEN = BlockState.WRITTEN

CachedFill = tuple[str, list[int], int, bool]
"""What vLLM cached in one call (:meth:`GuardedBlockPool.take_cached`): (request id,
the blocks a step in flight fills, the request's tokens they cover, ``once``: an entry
for one block that a step may register again after withdrawing it -- noted once)."""

CachedCopy = tuple[str, int, int]
"""A copy-on-write that took over a held entry (:meth:`GuardedBlockPool.take_copies`):
(request id, the copy's block id, the request's tokens its entry covers)."""

BlockStoredArgs = tuple[Any, int, int, int]
"""What vLLM's ``BlockStored`` event for a held block is built from: (vLLM's request,
block index, block size, KV cache group)."""


class GuardModeUnsupported(NotImplementedError):
    """A vLLM path the guarded pool does not cover (documented in docs/vllm-reference.md)."""


class PartialEntryError(PoolMisuseError, AssertionError):
    """``cache_partial_block`` asked for an entry at no prefix boundary of the request
    (a caller bug: vLLM's own pool fails the same call with an ``AssertionError``)."""


@dataclass(slots=True)
class TailEntry:
    """An entry vLLM registered inside a block (``cache_partial_block``), held back."""

    publication: PendingPublication
    """(key, parent, owner): the prefix the entry stands for, and the request writing it."""
    num_tokens: int
    """The prefix length the key covers."""
    on_release: bool
    """Published when its request releases the block after clean steps: an attention
    tail, whose tokens up to the entry never change. False: a Mamba state, which its
    request's next steps overwrite in place -- only a copy made while it still held
    the entry's state (vLLM's copy-on-write, :meth:`GuardedBlockPool.move_block_hashes`)
    is ever published."""


class KvGuardFreeQueue:
    """``free_block_queue`` in guarded mode: kvguard's free queue, read as vLLM's free list.

    vLLM's ``FreeKVCacheBlockQueue`` is a linked list whose head is evicted (handed out)
    first. kvguard's pool owns the free queue (:class:`kvguard.free_queue.FreeQueue`),
    so the reads vLLM code makes of the list -- SimpleCPU offloading's lazy mode walks it
    with ``iter_blocks_after``, the one read vLLM makes of it outside its own pool --
    are answered from kvguard's order, which is the order kvguard hands blocks out:
    quarantined blocks first (no hash: never offered for a store), then empty ones,
    then cached blocks (PUBLISHED/OFFLOADED, hashed, no reference) least recently
    released first, lowest retention class first. Every block yielded has
    ``ref_cnt == 0``; a block carries a hash only when kvguard validated it, so only
    validated KV is ever offered to a walker that stores hashed blocks. Everything else
    of vLLM's list (its links, its count, ``popleft``, ``remove``, ``append``...) raises
    :class:`GuardModeUnsupported`: the pool answers counts itself
    (``get_num_free_blocks``) and only kvguard changes its queue.

    As with vLLM's list, the pool must not change while an iteration is under way.
    """

    __slots__ = ("_blocks", "_core")

    def __init__(self, core: KvGuardPool, blocks: Sequence[GuardedKVCacheBlock]) -> None:
        self._core = core
        self._blocks = blocks

    def iter_blocks_after(self, cursor: KVCacheBlock | None) -> Iterator[GuardedKVCacheBlock]:
        """The free blocks in hand-out order (``BlockPool.free_block_ids``), from the
        head (``cursor`` None) or after ``cursor``; none after a block that is not
        queued (vLLM: a block off the list has no successor). vLLM 0.32/0.33's lazy
        offloading resumes its walk at the last block it visited; 0.34's starts at the
        head every step."""
        blocks = self._blocks
        after = None
        if cursor is not None:
            after = cursor.block_id
            if not (0 <= after < len(blocks) and blocks[after] is cursor):
                return  # not a block of this pool
        for block_id in self._core.free_block_ids(after):
            yield blocks[block_id]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # (introspection: copy, pickle, binding's walk)
            raise AttributeError(name)
        raise GuardModeUnsupported(
            f"free_block_queue.{name}: in guarded mode kvguard owns the free queue; vLLM "
            "code may walk it (iter_blocks_after, as SimpleCPU offloading's lazy mode "
            "does), not read its links or counts, nor change it"
        )


class GuardedBlockPool(BlockPool):
    """vLLM's block pool interface over kvguard's validation-gated pool."""

    def __init__(
        self,
        *args: Any,
        guard: GuardConfig,
        window_frees: Callable[[list[int]], bool | None] | None = None,
        **kwargs: Any,
    ) -> None:
        """vLLM's own constructor arguments (whatever the series takes, see
        _compat.block_pool_kwargs; its settings are read back from the attributes it
        sets), the guard's settings, and from a guarded scheduler, on a model with
        window groups, ``window_frees``: the pool's question on every release --
        whether every step that wrote the blocks vLLM frees passed: True or False
        while vLLM frees a running request's window, local chunk or R-SWA gap, None
        for any other release."""
        super().__init__(*args, **kwargs)
        if not guard.enabled:
            raise GuardConfigError(
                "GuardedBlockPool is always guarded: with the guard off, vLLM's own "
                "BlockPool runs (install_guarded_pool is for a guard that is on)"
            )
        self.guard = guard
        self.pending: dict[int, PendingPublication] = {}
        """Block id -> the publication held back for a block vLLM cached (or registered
        an entry for) until the step that fills it validates; gone when the block is
        validated, fails, or is released (:meth:`free_blocks`), or vLLM withdraws the
        entry."""
        self.held_events: dict[int, BlockStoredArgs] = {}
        """With vLLM's KV events on: block id -> what vLLM's ``BlockStored`` event is
        built from once the held block is published."""
        # The outbox (read it, never change it, outside the pool: take_cached and
        # take_copies drain it).
        self.cached_fills: list[CachedFill] = []
        self.cached_copies: list[CachedCopy] = []
        self.window_frees = window_frees
        core = KvGuardPool(
            self.num_gpu_blocks,
            self.hash_block_size,
            enable_caching=self.enable_caching,
            zero_policy=self.guard.zero_policy,
            check_invariants=self.guard.check_invariants,
            # kvguard's evictions are turned into vLLM's events / metrics when vLLM
            # wants them; otherwise nobody reads kvguard's event queue.
            record_events=self.enable_kv_cache_events or self.metrics_collector is not None,
            block_type=GuardedKVCacheBlock,
        )
        # vLLM's null block is block 0, held forever; kvguard hands out block 0 first.
        (null_id,) = core.allocate_blocks(1)
        core.take_blocks_to_zero()  # the null block is never read
        self.core = core
        # The core's façades, called directly on the per-step paths (no forwarding
        # frame of the pool's; with check_invariants they are the checking ones).
        self._block_steps = core.block_steps
        self._tier_gate = core.tier_gate
        self._record_events = core.record_events
        # The block objects vLLM's managers see are kvguard's own records.
        self.blocks = cast("list[GuardedKVCacheBlock]", core.block_records)
        # As vLLM's own blocks name their pool (0.34: by a weak reference), one
        # object for all, so that ``block.pool is self._pool_handle`` tells ours.
        self._pool_handle = handle = pool_handle(self)
        for block in self.blocks:
            block.pool = handle
        self.null_block = self.blocks[null_id]
        self.null_block.is_null = True
        if null_id != 0:
            raise ConsistencyError(f"kvguard handed out block {null_id} first, not block 0")
        # The noting loop of cache_full_blocks in C, when kvguard's extension is built.
        self._fill_notes: FillNotes | None = fill_notes(GuardedKVCacheBlock, _WRITTEN)
        self.get_num_free_blocks = core.get_num_free_blocks
        self._cached_block_id = core.prefix_index.get
        # vLLM code that reads the free list (SimpleCPU offloading's lazy mode) reads
        # kvguard's free queue, in kvguard's order.
        self.free_block_queue = KvGuardFreeQueue(core, self.blocks)
        self.tails: dict[int, TailEntry] = {}
        """Entries vLLM registered inside a block its request goes on writing (a prompt's
        tail with partial-block prefix hits), by block id: none is matchable until it
        is published (:meth:`cache_partial_block`)."""
        self.retentions: dict[int, int] = {}
        """Block id -> references vLLM took by writing ``ref_cnt`` for a copy-on-write,
        which kvguard does not count (:meth:`retain_for_copy`); vLLM's release of each
        is skipped."""
        self.tier_purgers = TierPurgers()
        """The tiers' purgers, registered by the guarded connectors that copy to them:
        every invalidation drops the tier copies it reports (:meth:`invalidate`)."""
        self.state_groups: frozenset[int] = frozenset()
        """KV cache groups whose blocks hold a state overwritten in place (Mamba): set
        by :func:`~kvguard.adapters.vllm.pool.manager.install_guarded_pool`."""

    # ------------------------------------------------------------------ validation
    #
    # A block is WRITTEN from the moment vLLM hands it to a request (it is allocated
    # because the step being scheduled writes it) until the step that *fills* it
    # validates -- the step during whose scheduling vLLM caches it -- or, for a partial
    # tail block, until its request ends after a clean step. A decode step writing one
    # more token into a partial block therefore costs the guard nothing.

    def take_cached(self) -> list[CachedFill]:
        """What vLLM cached since the last call (:data:`CachedFill`, in call order):
        the blocks a step in flight fills, their publications held in :attr:`pending`."""
        cached = self.cached_fills
        if cached:
            self.cached_fills = []
        return cached

    def take_copies(self) -> list[CachedCopy]:
        """The copy-on-writes since the last call that took over an entry
        (:meth:`move_block_hashes`) and whose copy is still held: each is published
        (:meth:`validate_fills`) if every step that computed the state it copies was
        counted clean, else its entry withdrawn (:meth:`withdraw`)."""
        copies = self.cached_copies
        if not copies:
            return copies
        self.cached_copies = []
        pending = self.pending
        return [copy for copy in copies if copy[1] in pending]  # (not released since)

    def validate_fills(
        self, block_ids: Sequence[int], seals: Mapping[int, int] | None = None
    ) -> BlockValidation:
        """The steps that filled ``block_ids`` produced finite logits for their
        requests: kvguard validates the blocks and publishes those it holds a
        publication for (:attr:`pending`); ``seals``, what the workers' seals of
        them are (block id -> seal), recorded with each (unsealed without)."""
        pending = self.pending
        publications = {b: pending.pop(b) for b in block_ids if b in pending} if pending else None
        result = self._block_steps.validate_blocks(block_ids, publications, seals)
        events = self.held_events
        if events:  # vLLM's KV events are on
            blocks = self.blocks
            for done in (result.published, result.duplicates):
                for block_id in done:
                    held = events.pop(block_id, None)
                    if held is not None:
                        self._emit_block_stored(blocks[block_id], *held)
        return result

    def fail_fills(self, block_ids: Iterable[int]) -> tuple[int, ...]:
        """The steps that filled ``block_ids`` failed (or can never be validated):
        quarantine what they wrote."""
        quarantined = self._block_steps.fail_blocks(block_ids)
        self.withdraw(quarantined)
        return quarantined

    def withdraw(self, block_ids: Iterable[int]) -> bool:
        """The publications (and vLLM events) held for ``block_ids`` go: their blocks
        are never published under them. Whether one was held."""
        pending = self.pending
        events = self.held_events
        found = False
        for block_id in block_ids:
            if pending.pop(block_id, None) is not None:
                found = True
            if events:
                events.pop(block_id, None)
        return found

    def take_blocks_to_zero(self) -> list[int]:
        return self.core.take_blocks_to_zero()

    # ------------------------------------------------------------------ lookups

    def get_cached_block(
        self, block_hash: Any, kv_cache_group_ids: list[int]
    ) -> list[KVCacheBlock] | None:
        out = []
        lookup = self._cached_block_id
        for group_id in kv_cache_group_ids:
            # make_block_hash_with_group_id, inlined (BlockHash is a NewType).
            block_id = lookup(block_hash + group_suffix(group_id))
            if block_id is None:
                return None
            out.append(self.blocks[block_id])
        return out

    # ------------------------------------------------------------------ publication

    def cache_full_blocks(
        self,
        request: Any,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: list[bool] | None = None,
    ) -> None:
        if num_cached_blocks >= num_full_blocks:
            return
        hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, block_size)
        # make_block_hash_with_group_id(h, g) is h + g's 4 big-endian bytes (inlined:
        # BlockHash/BlockHashWithGroupId are NewTypes, i.e. calls that return their arg).
        suffix = group_suffix(kv_cache_group_id)
        parent: BlockHash | None = None
        if num_cached_blocks:
            parent = hashes[num_cached_blocks - 1] + suffix
        owner = request.request_id
        events = self.enable_kv_cache_events
        filled: list[int] = []
        publications = self.pending
        notes = self._fill_notes
        if not (
            notes is not None
            and block_mask is None
            and not events
            and notes.note(
                blocks,
                hashes,
                num_cached_blocks,
                num_full_blocks,
                suffix,
                parent,
                owner,
                block_size,
                publications,
                filled,
            )
        ):
            # Not the common case (every block WRITTEN by the step being scheduled, no
            # mask, no KV events), or no compiled noting: the loop below.
            self._note_fills(
                request,
                blocks,
                hashes,
                num_cached_blocks,
                num_full_blocks,
                block_size,
                kv_cache_group_id,
                block_mask,
                suffix,
                parent,
                publications,
                filled,
            )
        if filled:
            self.cached_fills.append((owner, filled, num_full_blocks * block_size, False))
            if self.tails:  # a full block's key replaces an entry inside it
                for block_id in filled:
                    self.tails.pop(block_id, None)

    def _note_fills(
        self,
        request: Any,
        blocks: list[KVCacheBlock],
        hashes: Any,
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: list[bool] | None,
        suffix: bytes,
        parent: BlockHash | None,
        publications: dict[int, PendingPublication],
        filled: list[int],
    ) -> None:
        """Note each block of ``blocks[num_cached_blocks:num_full_blocks]`` a step in
        flight writes (appended to ``filled``, its publication held back in
        ``publications``); publish at once those no step in flight writes."""
        owner = request.request_id
        events = self.enable_kv_cache_events
        held_events = self.held_events
        i = num_cached_blocks
        for block, block_hash in zip(
            blocks[num_cached_blocks:num_full_blocks],
            hashes[num_cached_blocks:num_full_blocks],
            strict=True,
        ):
            key: BlockHash = block_hash + suffix
            if block_mask is None or block_mask[i - num_cached_blocks]:
                block_id = block.block_id
                if block.state is _WRITTEN:  # (never the null block: it is ALLOCATED)
                    # Filled by the step being scheduled: published when it validates.
                    block.num_hash_tokens = (i + 1) * block_size
                    filled.append(block_id)
                    publications[block_id] = (key, parent, owner)
                    if events:
                        held_events[block_id] = (request, i, block_size, kv_cache_group_id)
                elif not block.is_null:
                    self._publish_now(block, key, parent, request, i, block_size, kv_cache_group_id)
            parent = key
            i += 1

    def _publish_now(
        self,
        block: Any,
        key: BlockHash,
        parent: BlockHash | None,
        request: Any,
        index: int,
        block_size: int,
        group_id: int,
    ) -> None:
        """A block vLLM caches that no in-flight step writes: publish it now."""
        block.num_hash_tokens = (index + 1) * block_size
        try:
            self._block_steps.publish_block(block.block_id, key, parent, owner=request.request_id)
        except IllegalTransitionError:
            return  # quarantined by a failed step: never published
        if self.enable_kv_cache_events:
            self._emit_block_stored(block, request, index, block_size, group_id)

    def _emit_block_stored(
        self, block: Any, request: Any, index: int, block_size: int, group_id: int
    ) -> None:
        """vLLM's ``BlockStored`` for a block kvguard just published (or holds as a
        duplicate), built from vLLM's request as vLLM's own pool builds it."""
        start = index * block_size
        end = start + block_size
        parent_hash = None
        if index:
            prev = resolve_block_hashes(request.block_hashes, self.hash_block_size, block_size)
            parent_hash = maybe_convert_block_hash(prev[index - 1])
        extra_keys = event_extra_keys(self, request, start, end)
        key = BlockHashWithGroupId(block.block_hash)
        self.kv_event_queue.append(
            self._build_block_stored_event(
                request,
                block_hashes=[maybe_convert_block_hash(get_block_hash(key))],
                parent_block_hash=parent_hash,
                start_token_idx=start,
                end_token_idx=end,
                block_size=block_size,
                kv_cache_group_id=group_id,
                extra_keys_list=[extra_keys],
                **block_stored_lookahead(self, request, end),
            )
        )

    def _report_core_removals(self) -> None:
        """Turn kvguard's eviction/invalidation events into vLLM's ``BlockRemoved``
        events and eviction metrics (kvguard records events only when vLLM wants these)."""
        collector = self.metrics_collector
        events = self.enable_kv_cache_events
        for event in self.core.take_events():
            if not isinstance(event, CoreBlockRemoved):
                continue  # BlockStored: vLLM's own is built from vLLM's request
            for block_id, key in zip(event.block_ids, event.block_hashes, strict=True):
                if collector:
                    collector.on_block_evicted(self.blocks[block_id])
                if events:
                    self.kv_event_queue.append(
                        BlockRemoved(
                            block_hashes=[maybe_convert_block_hash(get_block_hash(key))],
                            medium=self.medium,
                            group_idx=get_group_id(key),
                        )
                    )

    # ------------------------------------------------------------------ allocation

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        try:
            # WRITTEN: handed out because the step being scheduled writes them (or a
            # connector loads KV into them), unvalidated until the step that fills them.
            ids = self._block_steps.allocate_blocks(num_blocks, write=True)
        except OutOfBlocksError:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool") from None
        blocks = self.blocks
        ret = list(map(blocks.__getitem__, ids))
        if self._reuse_watchers:
            self._notify_reuse(ret)
        collector = self.metrics_collector
        if self._record_events:
            self._report_core_removals()
            if collector:
                for block in ret:
                    collector.on_block_allocated(block)
        return ret

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """A reference on each block, released later through :meth:`free_blocks`: a
        prefix hit on a cached block (kvguard acquires it), or a connector pinning
        blocks a request holds while it copies them -- SimpleCPU offloading pins the
        blocks a load writes into (WRITTEN) and those a store reads. A block that is
        not cached has one owner in kvguard (its request), so such a pin is a reference
        kvguard does not count, as for :meth:`retain_for_copy`: the first of the two
        releases is skipped and the block stays held until the second (vLLM's
        :meth:`is_block_writable` counts it, as vLLM's ``ref_cnt`` would)."""
        ids = [b.block_id for b in blocks if not b.is_null]
        try:
            self._block_steps.acquire_blocks(ids)
        except IllegalTransitionError:
            self._pin_held(ids)
        collector = self.metrics_collector
        if collector:
            for block in blocks:
                if not block.is_null:
                    collector.on_block_accessed(block)

    def free_blocks(
        self,
        ordered_blocks: Iterable[KVCacheBlock],
        evict_first: bool = False,
        *,
        steps_passed: bool = False,
    ) -> None:
        """vLLM's release of ``ordered_blocks`` (in order), with how it goes: blocks
        still WRITTEN -- no step validated them -- are validated as they are released
        when ``steps_passed`` (every step that wrote them passed: a request leaving
        after a clean step), else quarantined (zeroed before reuse). vLLM's own calls
        pass nothing; only a window free -- whose steps the guarded scheduler knows
        (:attr:`window_frees`) -- is released as those steps went. A publication still
        held back for a released block dies with its last reference.

        ``evict_first`` (vLLM 0.34; SimpleCPU offloading, for blocks a lower tier
        holds): the freed cached blocks are evicted before the other cached blocks
        (``BlockSteps.evict_first``; quarantined and empty blocks still go first).
        SimpleCPU's lazy mode counts on it: it copies the blocks nearest eviction, and
        a copied block put back at the eviction end is what the next allocation takes,
        not a block no tier holds yet."""
        released = ordered_blocks if isinstance(ordered_blocks, list) else list(ordered_blocks)
        if self.retentions:
            released = self._skip_retentions(released)
        handle = self._pool_handle
        ids = [block.block_id for block in released if block.pool is handle and not block.is_null]
        other_pools: dict[Any, list[KVCacheBlock]] | None = None
        if len(ids) != len(released):  # null blocks, or blocks of another pool
            other_pools = {}
            for block in released:
                if block.pool is not handle and not block.is_null:
                    pool = owning_pool(block)
                    if pool is not None:  # (0.34: a pool gone is skipped, as vLLM does)
                        other_pools.setdefault(pool, []).append(block)
        window_frees = self.window_frees
        if window_frees is not None:
            passed = window_frees(ids)
            if passed is not None:
                steps_passed = passed
        tails = self.tails
        if tails and not tails.keys().isdisjoint(ids):
            self._settle_tails(ids, steps_passed)
        # (kvguard raises, changing nothing, on a double free.)
        self._block_steps.release_blocks(ids, steps_passed=steps_passed)
        if evict_first:
            self._block_steps.evict_first(ids)
        pending = self.pending
        if pending and not pending.keys().isdisjoint(ids):
            # What is held for a block dies with its last reference (the block may be
            # reused: its next owner's fill holds its own).
            blocks = self.blocks
            events = self.held_events
            for block_id in ids:
                if block_id in pending and not blocks[block_id].ref_cnt:
                    del pending[block_id]
                    if events:
                        events.pop(block_id, None)
        for pool, others in other_pools.items() if other_pools else ():
            if evict_first:
                pool.free_blocks(others, evict_first)
            else:
                pool.free_blocks(others)

    def retain_for_copy(self, block: Any) -> None:
        """vLLM just took a reference on ``block`` by writing ``ref_cnt += 1``, to keep a
        copy-on-write's endpoint until the copy ran (``_apply_cow``), and will release
        it through :meth:`free_blocks`. kvguard does not count it -- a block being
        written has one owner, and the copy runs in the step being scheduled, before
        any block freed now is reused -- so the reference is disowned and that release
        skipped."""
        self._block_steps.disown_reference(block.block_id)
        block_id = block.block_id
        self.retentions[block_id] = self.retentions.get(block_id, 0) + 1

    def is_block_writable(self, block: KVCacheBlock) -> bool:
        """vLLM's question before it moves a block within its request's table (its Mamba
        speculative relocation asserts it, 0.32 to 0.34): one owner, no entry. Answered
        as vLLM's own pool would: a reference kvguard keeps apart from ``ref_cnt`` (a
        connector's pin, a copy-on-write's: :attr:`retentions`) is a second owner, and
        an entry inside the block (:attr:`tails`) is a hash. (A full block's key held in
        :attr:`pending` is not looked up: vLLM's pool would not have inserted it yet.)"""
        if block.is_null or block.ref_cnt != 1 or block.block_hash is not None:
            return False
        return block.block_id not in self.retentions and block.block_id not in self.tails

    def _pin_held(self, block_ids: list[int]) -> None:
        """:meth:`touch` of blocks some of which are not cached: acquire the cached
        ones, pin the held ones (see :meth:`touch`); a block neither cached nor held
        is refused by kvguard (IllegalTransitionError, nothing changed)."""
        blocks = self.blocks
        pins = [
            b for b in block_ids if blocks[b].ref_cnt and blocks[b].state not in MATCHABLE_STATES
        ]
        pinned = set(pins)
        self._block_steps.acquire_blocks([b for b in block_ids if b not in pinned])
        retentions = self.retentions
        for block_id in pins:
            retentions[block_id] = retentions.get(block_id, 0) + 1

    def _skip_retentions(self, released: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """``released`` without the releases of references kvguard did not count."""
        retentions = self.retentions
        kept = []
        for block in released:
            block_id = block.block_id
            left = retentions.get(block_id)
            if left is None:
                kept.append(block)
            elif left > 1:
                retentions[block_id] = left - 1
            else:
                del retentions[block_id]
        return kept

    def _settle_tails(self, ids: list[int], steps_passed: bool) -> None:
        """The entries inside the blocks whose last reference ``ids`` drops go; an
        attention tail whose request leaves after clean steps is published first."""
        blocks = self.blocks
        for block_id in ids:
            block = blocks[block_id]
            if block.ref_cnt != 1 or block_id not in self.tails:
                continue
            entry = self.tails.pop(block_id)
            if steps_passed and entry.on_release and block.state is _WRITTEN:
                block.num_hash_tokens = entry.num_tokens
                self.pending[block_id] = entry.publication
                self.validate_fills([block_id])

    # ------------------------------------------------------------------ cache control

    def evict_blocks(self, block_ids: set[int]) -> None:
        """KV that failed to load: taint it in kvguard (quarantined, zeroed on reuse)."""
        core = self.core
        hashes = []
        for block_id in block_ids:
            assert block_id < len(self.blocks), (
                f"Invalid block_id {block_id} >= {len(self.blocks)}: the KV connector "
                "reported a block the scheduler never allocated"
            )
            key = core.block_hash(block_id)
            if key is not None:
                hashes.append(key)
        if hashes:
            self.invalidate(hashes, descendants=False)

    def invalidate(
        self, block_hashes: Iterable[BlockHash], *, descendants: bool = True
    ) -> TierPurgeReport:
        """Taint ``block_hashes`` (kvguard's keys) found corrupt after the fact
        (:meth:`kvguard.BlockPool.invalidate`: GPU blocks quarantined, requests
        holding them aborted) and purge their copies from every tier that registered
        a purger (:mod:`kvguard.adapters.vllm.exits.tier_purge`)."""
        report = self._tier_gate.invalidate(block_hashes, descendants=descendants)
        if self._record_events:
            self._report_core_removals()
        return self.tier_purgers.purge(report)

    def reset_prefix_cache(self) -> bool:
        core = self.core
        watched = [self.blocks[b] for b in list(self._reuse_watchers)]
        if not core.reset_prefix_cache(keep_held=[self.null_block.block_id]):
            return False
        self.tails.clear()
        if watched:
            self._notify_reuse(watched)
        if core.record_events:
            core.take_events()  # one AllBlocksCleared below says it all
        if self.metrics_collector:
            self.metrics_collector.reset()
        if self.enable_kv_cache_events:
            from vllm.distributed.kv_events import AllBlocksCleared

            self.kv_event_queue.append(AllBlocksCleared())
        return True

    # ------------------------------------------------------------------ block entries
    #
    # Mamba groups (align mode) and partial-block prefix hits (hash_block_size <
    # block_size) register entries for single blocks besides cache_full_blocks. kvguard
    # publishes one key per block, and only bytes no step will change once the steps
    # that wrote them validated.

    def cache_partial_block(
        self,
        request: Any,
        block: KVCacheBlock,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> Any:
        """vLLM's entry for ``block`` at the prefix of ``num_tokens`` tokens: the key it
        stands under (held back until kvguard may publish it), or None when kvguard
        registers none.

        * At the block's end, or ``replace_existing_hashes`` (a Mamba checkpoint the
          step being scheduled exports into a block of its own): the step fills the
          block and never writes it again, so the key is held for that step like the
          keys ``cache_full_blocks`` notes.
        * Inside a block its request goes on writing (a prompt's tail with
          partial-block prefix hits): a :class:`TailEntry` (:attr:`tails`). An
          attention tail is published when its request releases the block after clean
          steps; a Mamba state only through the copy vLLM makes of it
          (:meth:`move_block_hashes`).

        A block keeps one key: an entry for a block that has or awaits another is not
        registered (None), unless ``replace_existing_hashes`` (its content was
        replaced) drops the old one first."""
        if block.is_null:
            return None
        per_hash = self.hash_block_size
        hashes = request.block_hashes
        units = num_tokens // per_hash
        if num_tokens <= 0 or units * per_hash != num_tokens or units > len(hashes):
            raise PartialEntryError(
                f"cache_partial_block({request.request_id!r}, block {block.block_id}, "
                f"num_tokens={num_tokens}): an entry stands at a positive multiple of the "
                f"hash block size ({per_hash}) within the request's {len(hashes)} block "
                "hash(es) (vLLM's BlockPool asserts the same); nothing was registered"
            )
        suffix = group_suffix(kv_cache_group_id)
        # vLLM's own key for the entry: the hash chained over the first num_tokens.
        key = hashes[units - 1] + suffix
        block_id = block.block_id
        held = self.pending.get(block_id)
        tail = self.tails.get(block_id)
        if (
            block.block_hash == key
            or (held is not None and held[0] == key)
            or (tail is not None and tail.publication[0] == key)
        ):
            return key  # published, or held, under this key already
        if replace_existing_hashes:
            self._maybe_evict_cached_block(block)
        elif block.block_hash is not None or held is not None or tail is not None:
            return None
        publication = (key, hashes[units - 2] + suffix if units > 1 else None, request.request_id)
        if block.state is not _WRITTEN:
            return None  # (quarantined by a failed step, or invalidated just above)
        if replace_existing_hashes or num_tokens % block_size == 0:
            block.num_hash_tokens = num_tokens
            self.pending[block_id] = publication
            self.cached_fills.append((request.request_id, [block_id], num_tokens, True))
        else:
            on_release = kv_cache_group_id not in self.state_groups
            self.tails[block_id] = TailEntry(publication, num_tokens, on_release)
        return key

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """vLLM takes every entry of ``block`` back: its content is about to be
        replaced (a transient Mamba checkpoint overwrites the block). A key held for
        it is withdrawn -- the block stays its step's fill, validated or quarantined
        with it, never published. A block already matchable is invalidated (kvguard
        has no way back from published for a block that is rewritten: it is
        quarantined and zeroed before reuse). Whether an entry went."""
        if block.is_null:
            return False
        if self.tails.pop(block.block_id, None) is not None:
            return True
        if self.withdraw([block.block_id]):
            return True
        key = block.block_hash
        if key is None:
            return False
        self._tier_gate.invalidate([key], descendants=False)
        if self._record_events:
            self._report_core_removals()
        return True

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        """vLLM's copy-on-write of a Mamba prompt tail: ``dst_block``, new, receives a
        copy of ``src_block`` before the step being scheduled overwrites it, and takes
        over its entry, held (:attr:`pending`) and put in the outbox
        (:meth:`take_copies`): whoever drives the pool publishes the copy -- before
        vLLM releases it -- if every step that computed the state reported and was
        counted clean (no step writes it after the copy, which runs before anything
        reads it: vLLM holds back hits on it within this step), else withdraws the
        entry (under async scheduling the step that wrote the state is still in flight
        when vLLM copies it, and vLLM returns the copy to the pool before that step
        reports).

        vLLM then takes a reference on ``src_block`` by writing ``ref_cnt`` (held until
        the copy ran), which kvguard does not count (:meth:`retain_for_copy`, called
        once vLLM's allocation returns: ``install_guarded_pool`` wraps it)."""
        entry = self.tails.pop(src_block.block_id, None)
        if entry is None:
            self._maybe_evict_cached_block(src_block)
            return
        if src_block.state is _WRITTEN and dst_block.state is _WRITTEN:
            dst_id = dst_block.block_id
            dst_block.num_hash_tokens = entry.num_tokens
            self.pending[dst_id] = entry.publication
            self.cached_copies.append((entry.publication[2], dst_id, entry.num_tokens))

    def unpin_blocks(self, blocks: Iterable[KVCacheBlock], on_reuse: Any) -> None:
        raise GuardModeUnsupported("unpin_blocks (read-until-reuse) in guarded mode")

    # ------------------------------------------------------------------ checks

    def check_consistency(self) -> None:
        """Check that what vLLM sees agrees with kvguard (tests; debugging): kvguard's
        invariants hold (else :class:`~kvguard.errors.InvariantViolation`), vLLM's
        block list is kvguard's records (each naming this pool), block 0 alone is the
        null block and stays held and uncached, and every publication still held back
        is for a block its step is writing. Raises :class:`~kvguard.errors.
        ConsistencyError` naming every disagreement found: a kvguard bug, never a
        caller's."""
        core = self.core
        core.check_invariants()
        blocks = self.blocks
        null = self.null_block
        broken = []
        if blocks is not core.block_records:
            broken.append("vLLM's blocks are not kvguard's records")
        handle = self._pool_handle
        broken += [f"block {b.block_id} names another pool" for b in blocks if b.pool is not handle]
        if null is not blocks[0]:
            broken.append(f"the null block is block {null.block_id}, not block 0")
        elif not null.is_null:
            broken.append("block 0, the null block, is not marked null")
        broken += [f"block {b.block_id} is a second null block" for b in blocks[1:] if b.is_null]
        if null.state is not BlockState.ALLOCATED or null.ref_cnt < 1:
            broken.append(f"the null block is {null.state.name}, ref_cnt={null.ref_cnt}")
        for block_id in {*self.pending, *self.held_events}:
            state = blocks[block_id].state
            if state is not _WRITTEN:
                broken.append(f"block {block_id} held for publication is {state.name}")
        for block_id in self.tails:
            block = blocks[block_id]
            if not block.ref_cnt or block.state not in (_WRITTEN, BlockState.QUARANTINED):
                broken.append(
                    f"block {block_id} with an entry inside it is {block.state.name}, "
                    f"ref_cnt={block.ref_cnt}"
                )
        if broken:
            raise ConsistencyError(
                "GuardedBlockPool.check_consistency: vLLM's view of the pool and "
                "kvguard's disagree (a kvguard bug): " + "; ".join(broken)
            )
