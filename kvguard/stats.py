"""Pool statistics: a frozen snapshot, per-state counts plus cumulative counters."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvguard.states import BlockState


@dataclass(slots=True)
class Counters:
    """Cumulative counters the pool bumps as it works, from its construction on (each
    only grows). ``stats().counters`` and ``counters()`` return a copy."""

    requests_added: int = 0
    """Requests opened by ``add_request``."""
    requests_aborted: int = 0
    """Requests aborted: by a failed step (``fail_step``) or because an invalidated
    block is in their block table (``invalidate``)."""
    steps_validated: int = 0
    """Request-level step results that passed (``validate_step``; discarded ones not)."""
    steps_failed: int = 0
    """Request-level step results that failed (``fail_step``; discarded ones not)."""
    blocks_quarantined: int = 0
    """Blocks that became QUARANTINED: written by a failed step, released while a step
    writing them was unvalidated, or invalidated (theirs or an ancestor's hash)."""
    blocks_zeroed: int = 0
    """Blocks queued for zeroing on reuse (``take_blocks_to_zero``): quarantined ones
    under ``ZeroPolicy.SUSPECT``, every allocated one under ``ZeroPolicy.ALL``."""
    slots_zeroed: int = 0
    """Token slots queued for wiping by tail rollbacks (``take_slots_to_zero``)."""
    blocks_published: int = 0
    """Blocks that entered the prefix index (PUBLISHED), each after its step validated."""
    deferred_publications: int = 0
    """Full blocks whose publication waited for their step's validation: a block a
    step fills (request level), or a publication recorded or handed in before the
    step writing the block validated (block level). A schedule-time cache (vLLM's, 0.32 to
    0.34) would have published these unvalidated; here they are published once the step
    validates, or never if it fails (``blocks_published`` counts what was)."""
    blocks_evicted: int = 0
    """Cached blocks with no reference that an allocation took back (their hash left
    the index)."""
    stores_started: int = 0
    """Copies to a lower tier begun (``begin_store``)."""
    stores_acknowledged: int = 0
    """Copies a tier acknowledged and the pool recorded (``ack_store`` returned True)."""
    stores_failed: int = 0
    """Copies a tier reported failed (``fail_store``)."""
    dropped_acks: int = 0
    """Store acknowledgements for blocks quarantined or reused meanwhile (``ack_store``
    returned False: the tier must discard the copy)."""
    hashes_invalidated: int = 0
    """Hashes ``invalidate`` dropped, descendants and hashes of tainted requests'
    later blocks included."""
    tainted_publications_refused: int = 0
    """Validated blocks not published because they chain on an invalidated hash."""
    lookups: int = 0
    """Prefix lookups (``lookup``)."""
    lookup_hit_tokens: int = 0
    """Tokens the lookups found cached (whole blocks)."""
    lookup_query_tokens: int = 0
    """Tokens the lookups asked for (capped by ``max_tokens``): the hit rate's
    denominator (``PoolStats.prefix_hit_rate``)."""
    blocks_sealed: int = 0
    """Blocks validated with a seal (``validate_blocks(..., seals=...)``): the
    fingerprint of the KV the validation vouched for, carried by their tier copies."""

    @property
    def withheld_publications(self) -> int:
        """Deprecated (to be removed in 0.2): the old name of
        :attr:`deferred_publications`, read-only."""
        warnings.warn(
            "Counters.withheld_publications is deprecated: it counts publications that "
            "waited for validation; read Counters.deferred_publications",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.deferred_publications


@dataclass(frozen=True, slots=True)
class PoolStats:
    """What :meth:`BlockPool.stats` found: a snapshot (walks every block, O(num_blocks))."""

    num_blocks: int
    block_size: int
    blocks_by_state: Mapping[BlockState, int]
    """Blocks in each state, every state present (0 where none is)."""
    num_free: int
    """Blocks an allocation can take now (``get_num_free_blocks``): the FREE and
    QUARANTINED blocks with no reference *and the evictable ones* (cached, PUBLISHED or
    OFFLOADED, with no reference). So it is not ``blocks_by_state[FREE]``, which counts
    FREE blocks alone."""
    num_evictable: int
    """Of ``num_free``, the cached blocks with no reference (a prefix hit can still use
    them; an allocation evicts them last)."""
    num_requests: int
    """Open requests."""
    zero_queue_blocks: int
    """Blocks queued for zeroing, not taken yet (``take_blocks_to_zero``)."""
    zero_queue_slots: int
    """Token slots queued for wiping, not taken yet (``take_slots_to_zero``)."""
    stores_in_flight: int
    """Tier copies begun and neither acknowledged nor failed yet."""
    counters: Counters = field(default_factory=Counters)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by someone (vLLM's ``get_usage``)."""
        return 1.0 - self.num_free / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        """``lookup_hit_tokens / lookup_query_tokens`` (0.0 before any lookup)."""
        c = self.counters
        return c.lookup_hit_tokens / c.lookup_query_tokens if c.lookup_query_tokens else 0.0
