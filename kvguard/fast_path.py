"""The compiled twins of the transition kernel's hot primitives (the optional C
extension ``kvguard._speedups``).

An engine's scheduler calls the pool several times per step, and in pure Python
kvguard's allocation, release, prefix-hit and validation calls cost more than vLLM's
own pool does for the same blocks (``docs/benchmarks.md``). The extension does the
common case of five primitives of :class:`kvguard.transition_kernel.TransitionKernel`
in C -- ``allocate``, ``acquire``, ``release_table``, ``release_held``,
``validate_held``, same names, same arguments -- (and the vLLM adapter's noting of
filled blocks, :func:`fill_notes`), with exactly the effects of the Python primitive;
anything else -- the zeroing policy "all", a validation while kvguard records events, a
release or validation that must raise, a clean release whose block still waits for its
publication -- declines (None/False, nothing changed) and the Python primitive runs: it
stays the reference and names every error. Both are tested against each other
(``tests/test_fast_path.py``).

It is built when the package is installed from source with a C compiler at hand;
without one, or with ``KVGUARD_PURE_PYTHON=1`` in the environment when a pool is
built, the pool runs in pure Python and behaves identically.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvguard.block import Block, PendingPublication
from kvguard.events import BlockRemoved, PoolEvent
from kvguard.free_queue import FreeQueue
from kvguard.hashing import BlockHash
from kvguard.states import BlockState
from kvguard.stats import Counters

if TYPE_CHECKING:
    from kvguard._speedups import FastPath, FillNotes

try:
    from kvguard import _speedups
except ImportError:  # built without a C compiler: pure Python
    _speedups = None  # type: ignore[assignment]

PURE_PYTHON_ENV = "KVGUARD_PURE_PYTHON"


def available() -> bool:
    """Whether pools built now use the compiled fast paths."""
    return _speedups is not None and os.environ.get(PURE_PYTHON_ENV, "") in ("", "0")


def fast_path(
    block_type: type[Block],
    blocks: list[Block],
    free: FreeQueue,
    index: dict[BlockHash, int],
    *,
    allocated: BlockState,
    written_from_allocated: BlockState,
    written: BlockState,
    freed: BlockState,
    validated: BlockState,
    published: BlockState,
    quarantined: BlockState,
    stays_cached: Sequence[BlockState],
    acquirable: Sequence[BlockState],
    evict_to: dict[BlockState, BlockState],
    counters: Counters,
    zero_blocks: dict[int, None],
    tainted: set[BlockHash],
    events: list[PoolEvent] | None,
    writers: dict[int, int],
    deferred: dict[int, PendingPublication],
    retention: dict[int, int],
    zero_all: bool,
    zero_suspect: bool,
) -> FastPath | None:
    """The compiled fast paths over one pool's records, or None (pure Python).

    The states are the pool's transitions read off its one table (the extension
    decides none itself): what allocation hands out, what a write of a fresh block
    makes, what a clean release frees to, what validation and publication lead to,
    what releasing an unvalidated block leads to (and stays on a release), the
    states a release leaves cached, those a prefix hit leaves as they are and where
    eviction takes each cached state. Evictions bump ``counters.blocks_evicted``;
    ``zero_blocks`` is the zero queue's set of block ids (``zero_suspect``: reused
    quarantined blocks join it, bumping ``counters.blocks_zeroed``; ``zero_all``: every
    allocation takes the Python path). A validation publishing a hash that is in
    ``tainted`` (the pool's set), or chained on one, takes the Python path.
    ``events`` is the kernel's event log, or None while events are not recorded;
    ``writers``, ``deferred`` and ``retention`` are its side tables.
    """
    if not available():
        return None
    return _speedups.FastPath(
        block_type,
        blocks,
        free,
        free.empty,  # the queue's own lists, appended to and popped in place
        free.quarantined,
        index,
        allocated,
        written_from_allocated,
        written,
        freed,
        validated,
        published,
        quarantined,
        tuple(stays_cached),
        tuple(acquirable),
        evict_to,
        counters,
        BlockRemoved,
        zero_blocks,
        tainted,
        events,
        writers,
        deferred,
        retention,
        zero_all,
        zero_suspect,
    )


def fill_notes(block_type: type[Block], written: BlockState) -> FillNotes | None:
    """The vLLM adapter's noting of filled blocks, compiled, or None (pure Python).

    ``block_type`` must have a ``num_hash_tokens`` slot (the adapter's block record);
    ``written`` is the state of a block a step being scheduled writes.
    """
    if not available():
        return None
    return _speedups.FillNotes(block_type, written)
