"""Tier copies found corrupt after the fact, purged from the tiers that hold them.

kvguard's core records which tiers hold an acknowledged copy of each hash
(``BlockPool.tier_copies``); :meth:`~kvguard.BlockPool.invalidate` drops that record
and *reports* the copies, for the tiers to drop. The tiers are vLLM's (the offloading
connector's CPU tier, SimpleCPU's CPU pool, a connector's store): each guarded
connector registers, per tier name, a purger that drops the tier's copies of the
hashes it is given and returns those it dropped.

:class:`TierPurgers` is that registry, one per guarded pool. Every invalidation of the
pool goes through it (:meth:`GuardedBlockPool.invalidate
<kvguard.adapters.vllm.pool.block_pool.GuardedBlockPool.invalidate>`: by hand, or KV a
connector failed to load), so no path taints a hash and leaves its tier copies
loadable. A reported copy whose tier has no purger (a tier kvguard cannot reach) is
named in the report and in one WARNING.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from vllm.logger import init_logger

from kvguard.hashing import BlockHash
from kvguard.results import InvalidationReport

logger = init_logger(f"vllm.{__name__}")

TierPurger = Callable[[Sequence[BlockHash]], Iterable[BlockHash]]
"""Drops the tier's copies of these hashes (kvguard's keys: vLLM's block hash and its
group id); returns the hashes whose copy it dropped."""


@dataclass(frozen=True, slots=True)
class TierPurgeReport:
    """What an invalidation dropped: the core's report, and per tier the hashes whose
    copy the tier dropped. ``unpurged`` are reported copies no registered tier took."""

    invalidation: InvalidationReport
    purged: dict[str, tuple[BlockHash, ...]]
    unpurged: tuple[tuple[str, BlockHash], ...] = ()

    @property
    def copies_purged(self) -> int:
        """How many tier copies were dropped, over every tier."""
        return sum(map(len, self.purged.values()))


class TierPurgers:
    """The purgers of a guarded pool's tiers, by tier name."""

    def __init__(self) -> None:
        self._purgers: dict[str, TierPurger] = {}

    def add(self, tier: str, purge: TierPurger) -> None:
        """Register the purger of ``tier`` (a connector bound again replaces its own)."""
        self._purgers[tier] = purge

    def __contains__(self, tier: str) -> bool:
        return tier in self._purgers

    def purge(self, report: InvalidationReport) -> TierPurgeReport:
        """Hand each tier the reported copies it holds; returns what they dropped."""
        wanted: dict[str, list[BlockHash]] = {}
        for tier, block_hash in report.tier_copies:
            wanted.setdefault(tier, []).append(block_hash)
        purged: dict[str, tuple[BlockHash, ...]] = {}
        unpurged: list[tuple[str, BlockHash]] = []
        for tier, hashes in wanted.items():
            purge = self._purgers.get(tier)
            if purge is None:
                unpurged += [(tier, h) for h in hashes]
                continue
            purged[tier] = tuple(purge(hashes))
        if unpurged:
            logger.warning(
                "kvguard: %d invalidated tier cop(ies) in tier(s) %s were not dropped: "
                "no purger is registered for that tier",
                len(unpurged),
                sorted({tier for tier, _ in unpurged}),
            )
        return TierPurgeReport(report, purged, tuple(unpurged))
