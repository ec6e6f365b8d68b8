"""Small drivers that read like an engine's step loop."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

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


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def run_benchmark(script: str, *args: str, env: Mapping[str, str | None] | None = None) -> str:
    """Run ``benchmarks/<script>`` with ``args`` as a user would, in a subprocess (vLLM's
    import configures logging; a benchmark's output stays out of this process), and
    return its stdout; a non-zero exit fails the test with the end of its stderr.

    ``env`` sets variables, or removes those mapped to None. KVGUARD_CHECK_INVARIANTS is
    always removed: benchmarks time the pool, not the checker.

    No time limit of its own: how long a benchmark takes depends on the machine's load,
    and the test's limit (pytest-timeout) ends a hung one; ``subprocess.run`` kills the
    child when that interrupts it."""
    full_env = dict(os.environ)
    full_env.pop("KVGUARD_CHECK_INVARIANTS", None)
    for name, value in (env or {}).items():
        if value is None:
            full_env.pop(name, None)
        else:
            full_env[name] = value
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        env=full_env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
