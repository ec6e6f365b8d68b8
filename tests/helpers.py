"""Small drivers that read like an engine's step loop."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvguard import BlockPool, BlockState, OutOfBlocksError, PoolMisuseError, PrefixHit


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


def ran_or_changed_nothing(
    pool: BlockPool, fn: Callable[..., object], *args: object, **kwargs: object
) -> bool:
    """Call ``fn``; True if it ran. On a typed misuse error (or running out of blocks)
    assert the pool's snapshot did not change, and return False."""
    before = pool.snapshot()
    try:
        fn(*args, **kwargs)
    except (PoolMisuseError, OutOfBlocksError):
        assert pool.snapshot() == before
        return False
    return True
