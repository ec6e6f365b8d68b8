"""One KV-cache block as the pool sees it (never the bytes, only the facts)."""

from __future__ import annotations

from dataclasses import dataclass

from kvguard.hashing import BlockHash
from kvguard.states import BlockState

PendingPublication = tuple[BlockHash, BlockHash | None, str]
"""(hash, parent hash, owner) a block is to be published under once validated."""


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    state: BlockState = BlockState.FREE
    ref_cnt: int = 0
    """References from request block tables plus block-level holders."""
    block_hash: BlockHash | None = None
    """Set while the block is PUBLISHED/OFFLOADED (or VALIDATED and full, for tier stores)."""
    parent_hash: BlockHash | None = None
    """Hash of the previous block of the same prefix, for taint propagation."""
    generation: int = 0
    """Bumped whenever the bytes stop being the ones a store ticket copied."""
    external_refs: int = 0
    """References held through the block-level API (allocate_blocks/acquire_blocks)."""
    # A block's retention class, its block-level writers in flight and its deferred
    # publication live in the transition kernel's side tables: most blocks have none,
    # and a record with fewer fields costs no more than vLLM's KVCacheBlock.


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """A read-only snapshot of one block, for callers and tests."""

    block_id: int
    state: BlockState
    ref_cnt: int
    block_hash: BlockHash | None
    generation: int
    retention: int

    @property
    def needs_zero(self) -> bool:
        """Quarantined bytes are zeroed before the next owner uses the block."""
        return self.state is BlockState.QUARANTINED

    @classmethod
    def of(cls, block: Block, retention: int = 0) -> BlockInfo:
        return cls(
            block.block_id,
            block.state,
            block.ref_cnt,
            block.block_hash,
            block.generation,
            retention,
        )
