"""``GuardedBlockPool``: vLLM's ``BlockPool`` interface, kvguard's pool underneath.

vLLM's ``KVCacheCoordinator``, ``SingleTypeKVCacheManager``s and ``KVCacheManager``
call this object exactly as they call ``vllm.v1.core.block_pool.BlockPool`` (it is a
subclass, so every attribute vLLM or a connector reads exists). Two modes:

* **pass-through** (``guard=None`` or ``GuardConfig(enabled=False)``): every call is
  vLLM's own code; behaviour is identical to vLLM's pool (checked against vLLM's own
  KV-cache tests).
* **guarded**: a :class:`kvguard.BlockPool` owns every block's state, the free queue
  (quarantined blocks first), the prefix index and the zero queue. vLLM's
  ``KVCacheBlock`` objects are views kept in step with it: ``ref_cnt`` and
  ``block_hash`` mirror kvguard's, so vLLM code reading them sees the truth.
  ``cache_full_blocks`` no longer inserts at schedule time: it asks kvguard to publish,
  and kvguard defers blocks whose step is still unchecked until
  :meth:`validate_step` says it passed. The guarded scheduler drives
  :meth:`take_step_fills` / :meth:`validate_step` / :meth:`settle_tail` /
  :meth:`fail_step`.

Guarded mode supports full-attention KV cache groups (MHA, GQA, MLA); sliding-window,
chunked-local and Mamba groups copy or re-point cached blocks (``move_block_hashes``,
``cache_partial_block``) and are refused at install time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvguard.adapters.vllm._compat import require_supported_vllm

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

from kvguard.errors import IllegalTransitionError, OutOfBlocksError  # noqa: E402
from kvguard.hashing import BlockHash  # noqa: E402
from kvguard.pool import BlockPool as KvGuardPool  # noqa: E402
from kvguard.results import BlockValidation, PublishOutcome  # noqa: E402
from kvguard.states import BlockState  # noqa: E402

from .config import GuardConfig  # noqa: E402

_WRITTEN = BlockState.WRITTEN


class GuardModeUnsupported(NotImplementedError):
    """A vLLM path the guarded pool does not cover (documented in docs/vllm.md)."""


class _FreeQueueOwnedByKvGuard:
    """Stands in for ``free_block_queue`` in guarded mode: kvguard's pool owns the order,
    and a stale linked list would mislead (SimpleCPUOffloadConnector's lazy mode)."""

    def __getattr__(self, name: str) -> Any:
        raise GuardModeUnsupported(
            f"free_block_queue.{name}: in guarded mode kvguard owns the free queue; "
            "connectors that walk vLLM's free list (SimpleCPUOffloadConnector lazy mode) "
            "are not supported yet"
        )


class GuardedBlockPool(BlockPool):
    """vLLM's block pool interface over kvguard's validation-gated pool."""

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        metrics_collector: Any = None,
        num_hash_lookahead_tokens: int = 0,
        *args: Any,
        guard: GuardConfig | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            num_gpu_blocks,
            enable_caching,
            hash_block_size,
            enable_kv_cache_events,
            metrics_collector,
            num_hash_lookahead_tokens,
            *args,
            **kwargs,
        )
        self.guard = guard if guard is not None else GuardConfig(enabled=False)
        self.core: KvGuardPool | None = None
        # block id -> (request, block index, block size, group, key) of a publication
        # that waits for its step, so that vLLM's hash and KV event can follow kvguard's.
        self._deferred: dict[int, tuple[Any, int, int, int, BlockHash]] = {}
        # request id -> blocks filled while the current step was being scheduled.
        self._fills: dict[str, list[int]] = {}
        if not self.guard.enabled:
            return
        core = KvGuardPool(
            num_gpu_blocks,
            hash_block_size,
            enable_caching=enable_caching,
            zero_policy=self.guard.zero_policy,
            check_invariants=self.guard.check_invariants,
        )
        # vLLM's null block is block 0, held forever; kvguard hands out block 0 first.
        (null_id,) = core.allocate_blocks(1)
        assert null_id == self.null_block.block_id == 0, "null block must be block 0"
        core.take_blocks_to_zero()  # the null block is never read
        self.core = core
        # vLLM asks for the free count on every allocate_slots call: kept here, in
        # step with kvguard's (check_mirror compares them), and answered in one call.
        self._num_free = core.get_num_free_blocks()
        self.get_num_free_blocks = self._guarded_num_free
        self.free_block_queue = _FreeQueueOwnedByKvGuard()

    # ------------------------------------------------------------------ steps (guarded)
    #
    # A block is WRITTEN from the moment vLLM hands it to a request (it is allocated
    # because the step being scheduled writes it) until the step that *fills* it
    # validates -- the step during whose scheduling vLLM caches it -- or, for a partial
    # tail block, until its request ends after a clean step. A decode step writing one
    # more token into a partial block therefore costs the guard nothing.

    def take_step_fills(self) -> dict[str, list[int]]:
        """Blocks filled (cached by vLLM) since the last call, per request id."""
        fills = self._fills
        self._fills = {}
        return fills

    def validate_step(self, block_ids: Sequence[int]) -> BlockValidation:
        """The steps that filled ``block_ids`` produced finite logits for their requests."""
        assert self.core is not None
        result = self.core.validate_blocks(block_ids)
        deferred = self._deferred
        if deferred:
            pop = deferred.pop
            blocks = self.blocks
            mirror = self._mirror_publication
            events = self.enable_kv_cache_events
            for done in (result.published, result.duplicates):
                for block_id in done:
                    pending = pop(block_id, None)
                    if pending is None:
                        continue
                    block = blocks[block_id]
                    if events:
                        mirror(block, *pending)
                    elif block._block_hash is None:
                        # _mirror_publication without events, inlined.
                        block._block_hash = pending[4]
                        block._block_hash_num_tokens = (pending[1] + 1) * pending[2]
        return result

    def settle_tail(self, block_lists: Iterable[Sequence[KVCacheBlock]]) -> None:
        """A request ends with no step in flight and its last step clean: validate the
        blocks it wrote that no step filled (its partial tail), so that releasing them
        does not quarantine them."""
        core = self.core
        assert core is not None
        state = core.block_state
        ids: list[int] = []
        for blocks in block_lists:
            # Blocks are filled, hence validated, in order: the unvalidated ones trail.
            for block in reversed(blocks):
                if block.is_null or state(block.block_id) is not _WRITTEN:
                    break
                ids.append(block.block_id)
        if ids:
            self.validate_step(ids)

    def fail_step(self, block_ids: Iterable[int]) -> tuple[int, ...]:
        """The step failed (or can never be validated): quarantine what it wrote."""
        assert self.core is not None
        quarantined = self.core.fail_blocks(block_ids)
        for block_id in quarantined:
            self._deferred.pop(block_id, None)
        return quarantined

    def take_blocks_to_zero(self) -> list[int]:
        return self.core.take_blocks_to_zero() if self.core is not None else []

    # ------------------------------------------------------------------ lookups

    def get_cached_block(
        self, block_hash: Any, kv_cache_group_ids: list[int]
    ) -> list[KVCacheBlock] | None:
        core = self.core
        if core is None:
            return super().get_cached_block(block_hash, kv_cache_group_ids)
        out = []
        for group_id in kv_cache_group_ids:
            # make_block_hash_with_group_id, inlined (BlockHash is a NewType).
            block_id = core.cached_block_id(block_hash + group_id.to_bytes(4, "big", signed=False))
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
        core = self.core
        if core is None:
            super().cache_full_blocks(
                request,
                blocks,
                num_cached_blocks,
                num_full_blocks,
                block_size,
                kv_cache_group_id,
                block_mask,
            )
            return
        if num_cached_blocks >= num_full_blocks:
            return
        hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, block_size)
        # make_block_hash_with_group_id(h, g) is h + g's 4 big-endian bytes (inlined:
        # BlockHash/BlockHashWithGroupId are NewTypes, i.e. calls that return their arg).
        suffix = kv_cache_group_id.to_bytes(4, "big", signed=False)
        parent: BlockHash | None = None
        if num_cached_blocks:
            parent = hashes[num_cached_blocks - 1] + suffix
        owner = request.request_id
        publish = core.publish_block
        deferred_outcome = PublishOutcome.DEFERRED
        deferred = self._deferred
        filled: list[int] | None = None
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            key: BlockHash = hashes[i] + suffix
            if not block.is_null and (block_mask is None or block_mask[i - num_cached_blocks]):
                block_id = block.block_id
                try:
                    outcome = publish(block_id, key, parent, owner=owner)
                except IllegalTransitionError:
                    pass  # quarantined by a failed step: never published
                else:
                    if outcome is deferred_outcome:
                        # Filled by the step being scheduled: published when it validates.
                        deferred[block_id] = (request, i, block_size, kv_cache_group_id, key)
                        if filled is None:
                            filled = self._fills.setdefault(owner, [])
                        filled.append(block_id)
                    else:
                        self._mirror_publication(
                            block, request, i, block_size, kv_cache_group_id, key
                        )
            parent = key

    def _mirror_publication(
        self,
        block: KVCacheBlock,
        request: Any,
        index: int,
        block_size: int,
        group_id: int,
        key: BlockHash,
    ) -> None:
        """kvguard published (or holds a duplicate of) ``block``: give vLLM's view its
        hash and emit vLLM's ``BlockStored`` now, after validation."""
        if block._block_hash is not None:
            return
        # KVCacheBlock.set_block_hash, inlined (its assert is the check above).
        block._block_hash = key  # a BlockHashWithGroupId: kvguard keys are vLLM's keys
        block._block_hash_num_tokens = (index + 1) * block_size
        if not self.enable_kv_cache_events:
            return
        start = index * block_size
        end = start + block_size
        parent_hash = None
        if index:
            prev = resolve_block_hashes(request.block_hashes, self.hash_block_size, block_size)
            parent_hash = maybe_convert_block_hash(prev[index - 1])
        extra_keys, _ = self._generate_event_extra_keys(request, start, end, 0)
        self.kv_event_queue.append(
            self._build_block_stored_event(
                request,
                block_hashes=[maybe_convert_block_hash(get_block_hash(BlockHashWithGroupId(key)))],
                parent_block_hash=parent_hash,
                start_token_idx=start,
                end_token_idx=end,
                block_size=block_size,
                kv_cache_group_id=group_id,
                extra_keys_list=[extra_keys],
                lookahead_token_ids=[self._lookahead_token_ids(request, end)]
                if self.num_hash_lookahead_tokens
                else None,
            )
        )

    def _forget_vllm_hash(self, block: KVCacheBlock) -> None:
        key = block.block_hash
        if key is None:
            return
        block.reset_hash()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(
                BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(get_block_hash(key))],
                    medium=self.medium,
                    group_idx=get_group_id(key),
                )
            )

    # ------------------------------------------------------------------ allocation

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        core = self.core
        if core is None:
            return super().get_new_blocks(num_blocks)
        try:
            # WRITTEN: handed out because the step being scheduled writes them (or a
            # connector loads KV into them), unvalidated until the step that fills them.
            ids = core.allocate_blocks(num_blocks, write=True)
        except OutOfBlocksError:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool") from None
        self._num_free -= num_blocks
        blocks = self.blocks
        ret = [blocks[i] for i in ids]
        if self._reuse_watchers:
            self._notify_reuse(ret)
        collector = self.metrics_collector
        events = self.enable_kv_cache_events
        for block in ret:
            if block._block_hash is not None:  # an evicted cached block
                if collector:
                    collector.on_block_evicted(block)
                if events:
                    self._forget_vllm_hash(block)
                else:  # KVCacheBlock.reset_hash, inlined
                    block._block_hash = None
                    block._block_hash_num_tokens = None
            assert block.ref_cnt == 0, f"block {block.block_id} handed out while referenced"
            block.ref_cnt = 1
            if collector:
                collector.on_block_allocated(block)
        return ret

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        core = self.core
        if core is None:
            super().touch(blocks)
            return
        live = [b for b in blocks if not b.is_null]
        core.acquire_blocks([b.block_id for b in live])
        collector = self.metrics_collector
        for block in live:
            if not block.ref_cnt:
                self._num_free -= 1  # an evictable cached block leaves the free queue
            block.ref_cnt += 1
            if collector:
                collector.on_block_accessed(block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        core = self.core
        if core is None:
            super().free_blocks(ordered_blocks)
            return
        ids: list[int] = []
        live: list[KVCacheBlock] = []
        other_pools: dict[Any, list[KVCacheBlock]] = {}
        for block in ordered_blocks:
            if block.is_null:
                continue
            pool = block.pool
            if pool is not None and pool is not self:
                other_pools.setdefault(pool, []).append(block)
                continue
            ids.append(block.block_id)
            live.append(block)
        # Released blocks whose step never validated are quarantined by kvguard here
        # (it raises, changing nothing, on a double free).
        core.release_blocks(ids)
        deferred = self._deferred
        num_last = 0  # blocks whose last reference went
        for block in live:
            ref = block.ref_cnt - 1
            block.ref_cnt = ref
            if not ref:
                num_last += 1
                if deferred:
                    deferred.pop(block.block_id, None)
        self._num_free += num_last
        for pool, others in other_pools.items():
            pool.free_blocks(others)

    # ------------------------------------------------------------------ cache control

    def evict_blocks(self, block_ids: set[int]) -> None:
        """KV that failed to load: taint it in kvguard (quarantined, zeroed on reuse)."""
        core = self.core
        if core is None:
            super().evict_blocks(block_ids)
            return
        hashes = []
        for block_id in block_ids:
            assert block_id < len(self.blocks), (
                f"Invalid block_id {block_id} >= {len(self.blocks)}: the KV connector "
                "reported a block the scheduler never allocated"
            )
            key = core.block_hash(block_id)
            if key is not None:
                hashes.append(key)
            self._forget_vllm_hash(self.blocks[block_id])
        if hashes:
            core.invalidate(hashes, descendants=False)

    def reset_prefix_cache(self) -> bool:
        core = self.core
        if core is None:
            return super().reset_prefix_cache()
        if not core.reset_prefix_cache(keep_held=[self.null_block.block_id]):
            return False
        if self._reuse_watchers:
            self._notify_reuse([self.blocks[b] for b in list(self._reuse_watchers)])
        for block in self.blocks:
            block.reset_hash()
        if self.metrics_collector:
            self.metrics_collector.reset()
        if self.enable_kv_cache_events:
            from vllm.distributed.kv_events import AllBlocksCleared

            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def _guarded_num_free(self) -> int:
        return self._num_free

    def take_events(self) -> list[Any]:
        if self.core is not None:
            # vLLM's events are built here from vLLM's requests; kvguard's own queue
            # carries the same facts and must not grow unbounded.
            self.core.take_events()
        return super().take_events()

    # ------------------------------------------------------------------ not covered

    def cache_partial_block(self, *args: Any, **kwargs: Any) -> Any:
        if self.core is not None:
            raise GuardModeUnsupported("partial-block prefix caching in guarded mode")
        return super().cache_partial_block(*args, **kwargs)

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        if self.core is not None:
            raise GuardModeUnsupported("copy-on-write of cached blocks in guarded mode")
        super().move_block_hashes(src_block, dst_block)

    def unpin_blocks(self, blocks: Iterable[KVCacheBlock], on_reuse: Any) -> None:
        if self.core is not None:
            raise GuardModeUnsupported("unpin_blocks (read-until-reuse) in guarded mode")
        super().unpin_blocks(blocks, on_reuse)

    # ------------------------------------------------------------------ checks

    def check_mirror(self) -> None:
        """Assert vLLM's block views agree with kvguard (tests; debugging)."""
        core = self.core
        if core is None:
            return
        core.check_invariants()
        assert self._num_free == core.get_num_free_blocks(), (
            f"free count {self._num_free} != kvguard's {core.get_num_free_blocks()}"
        )
        for block in self.blocks:
            info = core.block_info(block.block_id)
            if block.is_null:  # vLLM does not count the null block's references
                continue
            assert block.ref_cnt == info.ref_cnt, (block, info)
            if info.state in (BlockState.PUBLISHED, BlockState.OFFLOADED):
                assert block.block_hash == BlockHashWithGroupId(info.block_hash or b""), (
                    block,
                    info,
                )
            elif info.state is not BlockState.VALIDATED:
                assert block.block_hash is None, (block, info)
