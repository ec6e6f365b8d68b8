"""KV connectors see kvguard's pool, never the pool it replaced.

vLLM's ``Scheduler.__init__`` builds the KV cache manager and then binds its KV
connector to it (``bind_kv_cache_manager`` -> ``bind_gpu_block_pool``), before the
guarded scheduler swaps kvguard's pool in. A connector that keeps the pool it was
bound to (SimpleCPU offloading touches and reads GPU blocks through it, Mooncake's
store looks blocks up in it) would work on a pool no request uses any more. The guarded
scheduler binds the connectors again after the swap (every child of a
``MultiConnector`` too), and refuses to start, naming the connector, if one still
holds the discarded pool.

Mooncake's store and UMBP bind the same way (``bind_gpu_block_pool`` keeps the pool in
an attribute), but their scheduler sides open sockets and wait for their servers, so
they are not built here; the refusal below covers any connector binding again does
not reach.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (  # noqa: E402
    ExampleConnector,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
)
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvguard.adapters.vllm import GuardedBlockPool, GuardModeUnsupported, plugin  # noqa: E402
from kvguard.adapters.vllm.scheduler.guarded import GuardedScheduler  # noqa: E402

from .harness import (  # noqa: E402
    BLOCK,
    make_request,
    make_vllm_config,
    step,
    tensor_backed_kv_cache_config,
)
from .plugin_patches import undo_plugin_patches_after  # noqa: E402

NUM_BLOCKS = 64


def _scheduler(cls: type, kv_transfer_config: Any, *, enabled: bool = True) -> Any:
    """A real scheduler whose KV cache config has tensors (SimpleCPU offloading sizes
    its CPU tier from them)."""
    vllm_config = make_vllm_config(
        num_blocks=NUM_BLOCKS,
        kv_transfer_config=kv_transfer_config,
        kvguard={"check_invariants": True, "enabled": enabled},
    )
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    kv_cache_config = tensor_backed_kv_cache_config(spec, NUM_BLOCKS)
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
        log_stats=True,
    )


def _child(name: str) -> dict[str, Any]:
    return {
        "kv_connector": name,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 22},
    }


def _config(*names: str) -> KVTransferConfig:
    if len(names) == 1:
        return KVTransferConfig(**_child(names[0]))
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": [_child(n) for n in names]},
    )


def _bound_pools(scheduler: Any) -> dict[str, Any]:
    """The GPU block pool each connector of the scheduler holds (where it keeps one)."""
    out = {}
    connector = scheduler.connector
    for child in [connector, *getattr(connector, "_connectors", ())]:
        name = type(child).__name__
        manager = getattr(child, "scheduler_manager", None)  # SimpleCPUOffloadConnector
        if manager is not None:
            out[name] = manager._gpu_block_pool
        inner = getattr(child, "connector_scheduler", None)  # MooncakeStoreConnector
        if inner is not None and hasattr(inner, "_gpu_block_pool"):
            out[name] = inner._gpu_block_pool
    aux = getattr(scheduler, "aux_output_connector", None)
    if aux is not None and hasattr(aux, "_block_pool"):
        out["AuxOutputSchedulerConnector"] = aux._block_pool
    return out


CASES = {
    "simple-cpu": ("SimpleCPUOffloadConnector",),
    "multi": ("SimpleCPUOffloadConnector", "OffloadingConnector"),
}


@pytest.mark.parametrize("enabled", [True, False], ids=["guarded", "pass-through"])
@pytest.mark.parametrize("names", list(CASES.values()), ids=list(CASES))
def test_connectors_are_bound_to_kvguards_pool(
    names: tuple[str, ...], enabled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The plugin's connector factory: the gated classes in place of vLLM's names.
    undo_plugin_patches_after(monkeypatch)
    plugin._patch_connector_cls()
    stock = _scheduler(Scheduler, _config(*names))
    assert set(_bound_pools(stock).values()) == {stock.kv_cache_manager.block_pool}

    s = _scheduler(GuardedScheduler, _config(*names), enabled=enabled)
    pool = s.kv_cache_manager.block_pool
    # Pass-through is vLLM's own scheduler on vLLM's own pool, bound as vLLM binds it.
    assert type(s) is (GuardedScheduler if enabled else Scheduler)
    assert isinstance(pool, GuardedBlockPool) == enabled
    bound = _bound_pools(s)
    assert bound and all(p is pool for p in bound.values()), bound
    # And the engine runs on it as on vLLM's pool: a request through a few steps
    # (the offloading connectors keep the blocks of their unfinished stores).
    for scheduler in (stock, s):
        scheduler.add_request(make_request("r", list(range(100, 100 + 3 * BLOCK)), max_tokens=3))
        for _ in range(8):
            step(scheduler)
        assert not scheduler.requests
    assert pool.get_num_free_blocks() == stock.kv_cache_manager.block_pool.get_num_free_blocks()


class PinsFirstPool(ExampleConnector):
    """A connector that keeps the first pool it is bound to (binding again is ignored):
    nothing the guarded scheduler can rebind."""

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if getattr(self, "pinned", None) is None:
            self.pinned = gpu_block_pool


def test_a_connector_left_on_the_discarded_pool_refuses_the_start(tmp_path: Any) -> None:
    config = KVTransferConfig(
        kv_connector="PinsFirstPool",
        kv_connector_module_path=__name__,
        kv_role="kv_both",
        # (Declared to kvguard's connector gate, which would refuse an unknown one.)
        kv_connector_extra_config={
            "shared_storage_path": str(tmp_path),
            "kvguard_exit": "request_finished",
        },
    )
    stock = _scheduler(Scheduler, config)
    assert stock.connector.pinned is stock.kv_cache_manager.block_pool
    with pytest.raises(GuardModeUnsupported, match="PinsFirstPool") as raised:
        _scheduler(GuardedScheduler, config)
    assert "pinned" in str(raised.value)
