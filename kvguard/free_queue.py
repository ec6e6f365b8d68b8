"""The free queue: which block to hand out next.

Three tiers, taken in this order:

1. quarantined blocks (ref 0) — reused first so suspect bytes are zeroed and gone soon;
2. empty blocks (FREE: never held KV of value, or validated bytes nobody can match);
3. evictable cached blocks (PUBLISHED/OFFLOADED, ref 0) — least recently released
   first within the lowest retention class, so hot prefixes survive longest.

Runtime complexity: push and remove are O(1) and take(n) is O(n), each times O(log r)
with r distinct retention classes in use (usually one).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from sortedcontainers import SortedDict

from kvguard.block import Block
from kvguard.states import BlockState

_QUARANTINED = BlockState.QUARANTINED
_FREE = BlockState.FREE


class FreeQueue:
    """The free queue. Its fields are public for one reader and writer besides its own
    methods: the transition kernel's compiled twins (``kvguard._speedups``), which pop
    and append ``quarantined`` and ``empty`` in place, pop and fill eviction classes
    through ``first``/:meth:`eviction_class`/:meth:`drop_eviction_class`, and keep
    ``size`` and ``num_evictable`` in step. Everyone else reads them at most."""

    __slots__ = ("empty", "evictable", "first", "num_evictable", "quarantined", "retention", "size")

    def __init__(self, retention: dict[int, int] | None = None) -> None:
        self.retention: dict[int, int] = {} if retention is None else retention
        """Block id -> retention class where not 0 (the kernel's map, read here)."""
        self.quarantined: list[int] = []
        self.empty: list[int] = []
        # retention -> block ids in release order (oldest first).
        self.evictable: SortedDict = SortedDict()
        # (retention, bucket) of the lowest retention class, evicted first: looked up
        # on every evicting allocation, changed only when a class appears or empties.
        self.first: tuple[int, OrderedDict[int, None]] | None = None
        self.num_evictable = 0
        self.size = 0
        """Blocks queued, all tiers: kept as one number because engines ask for it on
        every allocation (vLLM: once per scheduled request)."""

    def __len__(self) -> int:
        return self.size

    def push(self, block: Block) -> None:
        """Enqueue a block whose reference count just reached zero."""
        state = block.state
        if state is _QUARANTINED:
            self.quarantined.append(block.block_id)
            self.size += 1
        elif state is _FREE:
            self.empty.append(block.block_id)
            self.size += 1
        else:
            self.push_evictable([block])

    def push_all_empty(self, block_ids: list[int]) -> None:
        """Enqueue FREE blocks so that ``block_ids[0]`` is handed out first."""
        self.empty.extend(reversed(block_ids))
        self.size += len(block_ids)

    def push_empty(self, block_ids: list[int]) -> None:
        """Enqueue FREE blocks (batched :meth:`push`)."""
        self.empty.extend(block_ids)
        self.size += len(block_ids)

    def eviction_class(self, retention: int) -> OrderedDict[int, None]:
        """The eviction queue of one retention class, created on first use."""
        bucket: OrderedDict[int, None] | None = self.evictable.get(retention)
        if bucket is None:
            bucket = self.evictable[retention] = OrderedDict()
            if self.first is None or retention < self.first[0]:
                self.first = (retention, bucket)
        return bucket

    def drop_eviction_class(self, retention: int) -> None:
        """Forget an emptied retention class."""
        del self.evictable[retention]
        first = self.first
        if first is not None and first[0] == retention:
            self.first = self.evictable.peekitem(0) if self.evictable else None

    def push_evictable(self, blocks: list[Block]) -> None:
        """Enqueue cached blocks, ``blocks[0]`` to be evicted first (batched :meth:`push`)."""
        classes = self.retention
        if not classes:  # the usual case: every block in class 0
            self.push_evictable_ids(0, [block.block_id for block in blocks])
            return
        key = classes.get(blocks[0].block_id, 0)
        bucket = self.eviction_class(key)
        for block in blocks:
            retention = classes.get(block.block_id, 0)
            if retention != key:
                key = retention
                bucket = self.eviction_class(key)
            bucket[block.block_id] = None
        self.num_evictable += len(blocks)
        self.size += len(blocks)

    def push_evictable_ids(self, retention: int, block_ids: list[int]) -> None:
        """Enqueue cached blocks of one retention class, ``block_ids[0]`` evicted first."""
        bucket = self.eviction_class(retention)
        # A plain loop: OrderedDict.update() is about twice as slow here.
        for block_id in block_ids:
            bucket[block_id] = None
        self.num_evictable += len(block_ids)
        self.size += len(block_ids)

    def take_empty(self, n: int) -> list[int] | None:
        """The fast path of :meth:`take`: the next ``n`` ids when they are all FREE
        blocks (no quarantined block waiting, enough empty ones); else None and nothing
        taken."""
        empty = self.empty
        if self.quarantined or len(empty) < n:
            return None
        ids = empty[-n:]
        del empty[-n:]
        ids.reverse()
        self.size -= n
        return ids

    def take(self, n: int) -> tuple[list[int], int, int]:
        """Take the next ``n`` ids in hand-out order: ``(ids, q, e)`` where the first
        ``q`` ids were quarantined and the last ``e`` were cached (now evicted); the
        caller checked ``0 < n <= len(self)``."""
        self.size -= n
        quarantined = self.quarantined
        empty = self.empty
        ids = []
        left = n
        num_quarantined = 0
        if quarantined:
            num_quarantined = min(left, len(quarantined))
            ids = quarantined[-num_quarantined:]
            del quarantined[-num_quarantined:]
            ids.reverse()
            left -= num_quarantined
        if left and empty:
            k = min(left, len(empty))
            taken = empty[-k:]
            del empty[-k:]
            taken.reverse()
            ids += taken
            left -= k
        num_evicted = left
        if left:
            self.num_evictable -= left
            while left:
                first = self.first
                assert first is not None, "take() past the end of the free queue"
                retention, bucket = first
                k = min(left, len(bucket))
                pop = bucket.popitem
                ids += [pop(False)[0] for _ in range(k)]
                left -= k
                if not bucket:
                    self.drop_eviction_class(retention)
        return ids, num_quarantined, num_evicted

    def in_order(self, after: Block | None = None) -> Iterator[int]:
        """The queued ids in hand-out order (:meth:`take`'s), from the head, or after
        ``after``: nothing after a block that is not queued. The queue must not change
        while the iteration runs."""
        quarantined, empty, classes = self.quarantined, self.empty, self.evictable
        if after is None:
            yield from reversed(quarantined)  # (taken from their ends)
            yield from reversed(empty)
            for bucket in classes.values():  # lowest retention class first
                yield from bucket
            return
        block_id = after.block_id
        if after.state is _QUARANTINED or after.state is _FREE:
            ids = quarantined if after.state is _QUARANTINED else empty
            try:
                position = ids.index(block_id)  # (a C-level scan)
            except ValueError:
                return  # held: not queued
            yield from reversed(ids[:position])
            if ids is quarantined:
                yield from reversed(empty)
            for bucket in classes.values():
                yield from bucket
            return
        retention = self.retention.get(block_id, 0)
        bucket = classes.get(retention)
        if bucket is None or block_id not in bucket:
            return
        # An OrderedDict has no positional access: one C-level copy and scan.
        ordered = list(bucket)
        yield from ordered[ordered.index(block_id) + 1 :]
        for key, later in classes.items():
            if key > retention:
                yield from later

    def evict_first(self, block_ids: list[int]) -> None:
        """Move the queued cached ones of ``block_ids`` to the front of their eviction
        class, ``block_ids[0]`` first: they are evicted before the class's other cached
        blocks (quarantined and empty blocks still go before any). Ids not queued as
        cached are skipped."""
        retention = self.retention
        classes = self.evictable
        for block_id in reversed(block_ids):
            bucket = classes.get(retention.get(block_id, 0))
            if bucket is not None and block_id in bucket:
                bucket.move_to_end(block_id, last=False)

    def remove_evictable(self, block: Block) -> None:
        """Take a cached block out of the queue (a prefix hit, or an invalidation)."""
        retention = self.retention.get(block.block_id, 0)
        bucket = self.evictable[retention]
        del bucket[block.block_id]
        if not bucket:
            self.drop_eviction_class(retention)
        self.num_evictable -= 1
        self.size -= 1

    def snapshot(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(quarantined, empty, evictable-in-eviction-order), for checks and tests."""
        evictable = tuple(bid for bucket in self.evictable.values() for bid in bucket)
        return tuple(self.quarantined), tuple(self.empty), evictable

    def clear_evictable(self) -> list[int]:
        """Remove and return every evictable block id (prefix-cache reset)."""
        out = [bid for bucket in self.evictable.values() for bid in bucket]
        self.evictable.clear()
        self.first = None
        self.size -= self.num_evictable
        self.num_evictable = 0
        return out
