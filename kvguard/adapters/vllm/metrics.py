"""What the guard did, as cumulative counters (kvguard's own collector).

``GuardMetrics.snapshot()`` merges the adapter's counters with the pool's; the
scheduler also logs them through vLLM's logger. Prometheus export goes through
:func:`kvguard.adapters.vllm.metrics.register_prometheus` when ``prometheus_client``
is installed (vLLM depends on it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class GuardMetrics:
    requests_aborted: int = 0
    """Requests finished with FINISHED_ERROR because a step's logits had NaN."""
    steps_validated: int = 0
    steps_unchecked: int = 0
    """Per-request step results without a NaN count (counted as clean)."""
    blocks_quarantined: int = 0
    blocks_zeroed: int = 0
    """Block ids handed to the worker through ``new_block_ids_to_zero``."""
    withheld_publications: int = 0
    """Full blocks vLLM would have cached at schedule time, published only once validated."""
    dropped_acks: int = 0
    """Offload store acknowledgements for blocks quarantined or reused meanwhile."""
    stores_refused: int = 0
    """Blocks an offload store job named that were not validated (left out of the job)."""

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}
