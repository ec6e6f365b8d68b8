"""Chained block hashes for the prefix index.

A block's hash covers its parent's hash, its token ids and (for the first block) an
optional salt, so equal hashes mean equal prefixes, not just equal blocks. The default
hasher is BLAKE2b-128 over the token ids' int64 bytes (machine byte order): collision-resistant
(a collision would serve another prompt's KV) and about a microsecond per block.
Engines that hash blocks themselves (vLLM does) pass their hashes in instead.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

BlockHasher = Callable[[BlockHash | None, Sequence[int], bytes | None], BlockHash]
"""``hasher(parent_hash, token_ids, salt) -> BlockHash``; salt is passed for block 0 only."""


def default_block_hasher(
    parent: BlockHash | None, token_ids: Sequence[int], salt: bytes | None
) -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    # A tag and a length prefix keep (parent | salt | tokens) unambiguous: a salt can
    # never impersonate a parent hash or a run of token ids.
    if parent is not None:
        h.update(b"P")
        h.update(parent)
    elif salt:
        h.update(b"S" + len(salt).to_bytes(4, "little"))
        h.update(salt)
    else:
        h.update(b"R")
    # The pool hands in slices of its int64 arrays: their bytes are hashed directly.
    h.update(token_ids if isinstance(token_ids, array) else array("q", token_ids))
    return BlockHash(h.digest())


def hash_block_tokens(
    token_ids: Sequence[int],
    block_size: int,
    *,
    salt: bytes | None = None,
    hasher: BlockHasher = default_block_hasher,
) -> list[BlockHash]:
    """Hashes of every *full* block of ``token_ids`` (a trailing partial block has none)."""
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hasher(parent, token_ids[start : start + block_size], salt)
        hashes.append(parent)
    return hashes
