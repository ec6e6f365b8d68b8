"""Small drivers that read like an engine's step loop."""

from __future__ import annotations

from collections.abc import Sequence

from kvguard import BlockPool, BlockState, PrefixHit


def admit(pool: BlockPool, rid: str, tokens: Sequence[int], *, use_cache: bool = True) -> PrefixHit:
    """Add a request, look its prefix up, allocate the whole prompt; return the hit."""
    pool.add_request(rid, tokens)
    hit = pool.lookup(rid, max_tokens=len(tokens) - 1) if use_cache else None
    pool.allocate(rid, len(tokens), hit=hit)
    return hit if hit is not None else PrefixHit(rid, (), (), 0)


def prefill(pool: BlockPool, rid: str, tokens: Sequence[int]) -> PrefixHit:
    """Admit and write the uncached rest of the prompt in one step (not yet validated)."""
    hit = admit(pool, rid, tokens)
    pool.write(rid, len(tokens) - hit.num_tokens)
    return hit


def states(pool: BlockPool, rid: str) -> list[BlockState]:
    return [pool.block_info(b).state for b in pool.block_table(rid)]
