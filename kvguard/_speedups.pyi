from collections.abc import Callable, Mapping
from typing import Any

from kvguard.block import Block
from kvguard.block import PendingPublication as PendingPublication
from kvguard.events import BlockRemoved, PoolEvent
from kvguard.free_queue import FreeQueue
from kvguard.hashing import BlockHash
from kvguard.states import BlockState
from kvguard.stats import Counters

class FastPath:
    def __init__(
        self,
        block_type: type[Block],
        blocks: list[Block],
        free_queue: FreeQueue,
        empty: list[int],
        quarantined: list[int],
        index: dict[BlockHash, int],
        allocated: BlockState,
        written_from_allocated: BlockState,
        written: BlockState,
        free: BlockState,
        validated: BlockState,
        published: BlockState,
        quarantined_state: BlockState,
        stays_cached: tuple[BlockState, ...],
        acquirable: tuple[BlockState, ...],
        evict_to: dict[BlockState, BlockState],
        counters: Counters,
        block_removed: type[BlockRemoved],
        zero_blocks: dict[int, None],
        tainted: set[BlockHash],
        events: list[PoolEvent] | None,
        writers: dict[int, int],
        deferred: dict[int, PendingPublication],
        retention: dict[int, int],
        zero_all: bool,
        zero_suspect: bool,
    ) -> None: ...
    def allocate(self, n: int, held: bool, write: bool) -> list[int]: ...
    def release_table(self, table: list[int], retention: int) -> None: ...
    def release_held(self, block_ids: list[int], steps_passed: bool) -> None: ...
    def validate_held(
        self, block_ids: list[int], publish: Mapping[int, PendingPublication] | None
    ) -> tuple[list[int], list[int], list[int]]: ...
    def acquire(self, block_ids: list[int], held: bool) -> None: ...
    def fallbacks(
        self,
        allocate: Callable[[int, bool, bool], list[int]],
        acquire: Callable[[list[int], bool], None],
        release_held: Callable[[list[int], bool], None],
        validate_held: Callable[
            [list[int], Mapping[int, PendingPublication] | None],
            tuple[list[int], list[int], list[int]],
        ],
        release_table: Callable[[list[int], int], None],
        settle_released: Callable[[list[Block], bool], None],
        drop_last_refs: Callable[[list[Block], int | None], None],
    ) -> None: ...

class FillNotes:
    def __init__(self, block_type: type[Block], written: BlockState) -> None: ...
    def note(
        self,
        blocks: list[Any],
        hashes: list[bytes],
        start: int,
        stop: int,
        suffix: bytes,
        parent: bytes | None,
        owner: str,
        block_size: int,
        publications: dict[int, PendingPublication],
        filled: list[int],
    ) -> bool: ...
