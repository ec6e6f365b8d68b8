"""Pool statistics: a frozen snapshot, per-state counts plus cumulative counters."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvguard.states import BlockState


@dataclass(slots=True)
class Counters:
    """Cumulative counters the pool bumps as it works (monotonic)."""

    requests_added: int = 0
    requests_aborted: int = 0
    steps_validated: int = 0
    steps_failed: int = 0
    blocks_quarantined: int = 0
    blocks_zeroed: int = 0
    """Blocks queued for zeroing on reuse."""
    slots_zeroed: int = 0
    """Token slots queued for wiping by tail rollbacks."""
    blocks_published: int = 0
    withheld_publications: int = 0
    """Full blocks a schedule-time cache (vLLM 0.33) would have published unvalidated."""
    blocks_evicted: int = 0
    stores_started: int = 0
    stores_acknowledged: int = 0
    stores_failed: int = 0
    dropped_acks: int = 0
    """Store acknowledgements for blocks quarantined or reused meanwhile."""
    hashes_invalidated: int = 0
    tainted_publications_refused: int = 0
    """Validated blocks not published because they chain on an invalidated hash."""
    lookups: int = 0
    lookup_hit_tokens: int = 0
    lookup_query_tokens: int = 0


@dataclass(frozen=True, slots=True)
class PoolStats:
    num_blocks: int
    block_size: int
    blocks_by_state: Mapping[BlockState, int]
    num_free: int
    """Blocks an allocation can take now (free, quarantined and evictable)."""
    num_evictable: int
    num_requests: int
    zero_queue_blocks: int
    zero_queue_slots: int
    stores_in_flight: int
    counters: Counters = field(default_factory=Counters)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by someone (vLLM's ``get_usage``)."""
        return 1.0 - self.num_free / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        c = self.counters
        return c.lookup_hit_tokens / c.lookup_query_tokens if c.lookup_query_tokens else 0.0
