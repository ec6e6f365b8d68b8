"""``GuardedKVCacheBlock``: kvguard's block record, read by vLLM as its ``KVCacheBlock``.

In guarded mode the objects in ``GuardedBlockPool.blocks`` -- the ones vLLM's
managers keep in their block tables -- are kvguard's own block records (the core pool
is built with ``block_type=GuardedKVCacheBlock``). vLLM reads ``block_id``,
``ref_cnt``, ``block_hash``, ``block_hash_num_tokens`` and ``is_null`` off them; each
is kvguard's value, written once by kvguard's pool, never a copy kept in step with it.

What vLLM reads, and what it is here:

* ``ref_cnt``: kvguard's reference count (the adapter holds every reference through
  the block-level API).
* ``block_hash``: the key kvguard published the block under (a vLLM
  ``BlockHashWithGroupId``: the adapter publishes under vLLM's keys), None until the
  step that filled the block validated.
* ``block_hash_num_tokens``: the prefix length that key covers while it is set.
* ``is_null``: vLLM's null block (block 0, held by the adapter forever).

vLLM's own writers of a block's hash (``set_block_hash`` / ``reset_hash``) belong to
the stock pool's code paths that the guarded pool replaces; they raise here, so a vLLM
path that is not covered cannot silently give a block a hash kvguard did not publish.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from kvguard.block import Block


class GuardedBlockHashWrite(RuntimeError):
    """vLLM code tried to set or clear a guarded block's hash itself."""


@dataclass(slots=True, eq=False)
class GuardedKVCacheBlock(Block):
    is_null: bool = False
    """vLLM's null block (block 0): a placeholder in block tables, never cached."""
    pool: Any = None
    """The ``GuardedBlockPool`` the block belongs to, as vLLM's series names it (0.34:
    a weak reference to it; see ``_compat.pool_handle``): vLLM routes frees that span
    several pools by it."""
    num_hash_tokens: int = 0
    """Prefix tokens the block's key covers, set by the adapter when it asks kvguard to
    publish the block (read through ``block_hash_num_tokens`` once published)."""
    # vLLM's free list links: unused (kvguard owns the free queue); present because vLLM
    # code may read them. Class attributes, not slots: a smaller record touches fewer
    # cache lines on the pool's hot paths.
    prev_free_block: ClassVar[None] = None
    next_free_block: ClassVar[None] = None

    @property
    def block_hash_num_tokens(self) -> int | None:
        return self.num_hash_tokens if self.block_hash is not None else None

    @property
    def _block_hash(self) -> Any:
        return self.block_hash

    def set_block_hash(self, block_hash: Any, num_tokens: int | None = None) -> None:
        raise GuardedBlockHashWrite(
            f"block {self.block_id}: in guarded mode only kvguard publishes block hashes"
        )

    def reset_hash(self) -> None:
        raise GuardedBlockHashWrite(
            f"block {self.block_id}: in guarded mode only kvguard drops block hashes"
        )
