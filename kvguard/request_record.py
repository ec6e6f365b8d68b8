"""Per-request bookkeeping: the block table and the write/validate ledger.

::

    token positions   0 ............ num_validated ........ num_written ...... capacity
                      |<- validated ->|<- written by steps ->|<- allocated ->|
                                       still in flight (pending)

``pending`` holds the end position of every step that was scheduled and whose result
has not arrived yet, oldest first. Results arrive in that order (sync and async
scheduling alike), so validating a step moves ``num_validated`` to ``pending[0]``.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass, field

from kvguard.hashing import BlockHash
from kvguard.results import PrefixHit


@dataclass(slots=True, eq=False)
class RequestRecord:
    request_id: str
    token_ids: array[int]
    """Token ids known so far (prompt, then appended outputs); used for hashing."""
    salt: bytes | None
    retention: int
    explicit_hashes: bool
    """True when the caller supplies block hashes instead of token ids."""
    block_hashes: list[BlockHash] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_written: int = 0
    num_validated: int = 0
    num_prompt_tokens: int = 0
    pending: deque[int] = field(default_factory=deque)
    discarded: deque[int] = field(default_factory=deque)
    """End positions of steps that were in flight when the request aborted; their
    results are still expected and are discarded when they arrive."""
    aborted: bool = False
    hit: PrefixHit | None = None
    """The prefix hit the latest lookup() returned: the one allocate() accepts."""
    publish_cursor: int = 0
    """Leading blocks whose publication was already decided (published, a hit, or a
    duplicate of a hash someone else published first)."""
