"""The CPU worker's memory set-up (``vllm/v1/worker/cpu_worker.py``)."""

from __future__ import annotations

from .library import op


@op("init_cpu_memory_env(SymInt[] node_ids) -> ()")
def init_cpu_memory_env(node_ids: list[int]) -> None:
    """A no-op: vLLM's kernel binds the worker's memory to its NUMA nodes, a speed-up
    that tiny test models do not need (and a single-node test machine cannot show)."""
