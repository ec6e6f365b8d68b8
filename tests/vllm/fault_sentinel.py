"""vLLM's engine fault sentinel (``EngineCoreSentinel``) over a stand-in engine, as
vLLM's own fault-tolerance tests build it: the tests call its ``on_fault`` on a real
scheduler without a multiprocess engine core. Needs vLLM; imported by the tests that
call it (scheduler level and real engine)."""

from __future__ import annotations

import queue
from types import SimpleNamespace
from typing import Any


def sentinel_over(scheduler: Any, batch_queue: Any = None) -> tuple[Any, Any]:
    """vLLM's sentinel and the engine stand-in it acts on: exactly what ``on_fault``
    and ``_drain_batch_queue`` read of an ``EngineCoreProc`` (its scheduler, the batch
    queue, and sinks for the abort outputs -- ``engine.aborted`` -- and status pushes)."""
    from vllm.v1.fault_tolerance.engine_core_sentinel import EngineCoreSentinel

    engine = SimpleNamespace(
        engine_index=0,
        scheduler=scheduler,
        aborted=[],
        model_executor=SimpleNamespace(),  # not failed: the engine becomes UNHEALTHY
        batch_queue=batch_queue,
        output_queue=queue.Queue(),
    )
    engine._send_abort_outputs = engine.aborted.extend
    # The engine's parallel config (0.34 also reads data_parallel_size).
    config = SimpleNamespace(
        fault_tolerance_config=SimpleNamespace(engine_recovery_timeout_sec=1),
        data_parallel_size=1,
    )
    return EngineCoreSentinel(engine, config), engine
