"""The vLLM plugin: KVGUARD_GUARD=1 turns the guard on with no code change, including
worker-side zeroing (the KVCacheConfig vLLM builds for its workers says so)."""

from __future__ import annotations

import pickle
import sys
from collections.abc import Iterator

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

import torch  # noqa: E402
import vllm  # noqa: E402
import vllm.v1.worker.gpu.model_runner as v2_runner  # noqa: E402
from vllm.v1.attention.backends.utils import record_kv_cache_layout  # noqa: E402
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig  # noqa: E402

from kvguard.adapters.vllm import config as settings  # noqa: E402
from kvguard.adapters.vllm import plugin  # noqa: E402
from kvguard.adapters.vllm._compat import (  # noqa: E402
    UnsupportedVllmError,
    has_v1_model_runner,
)
from kvguard.adapters.vllm.config import GuardConfigError  # noqa: E402
from kvguard.adapters.vllm.scheduler.guarded import (  # noqa: E402
    GuardedAsyncScheduler,
    GuardedScheduler,
)

from .conftest import undo_plugin_patches_after  # noqa: E402
from .harness import (  # noqa: E402
    BLOCK,
    make_request,
    make_scheduler,
    make_vllm_config,
    step,
    worker_kv_cache_configs,
)


@pytest.fixture
def restore_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Whatever the plugin patches is put back after the test."""
    undo_plugin_patches_after(monkeypatch)
    yield monkeypatch


@pytest.fixture
def plugin_on(restore_vllm: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    restore_vllm.setenv("KVGUARD_GUARD", "1")
    restore_vllm.delenv("VLLM_COMPUTE_NANS_IN_LOGITS", raising=False)
    plugin.register()
    plugin.register()  # vLLM may load plugins more than once per process
    return restore_vllm


def _worker_kv_cache_configs() -> list[KVCacheConfig]:
    """What vLLM's EngineCore builds and sends to its workers, for a plain
    full-attention model (no Mamba, one precision)."""
    vllm_config = make_vllm_config()
    record_kv_cache_layout(vllm_config.cache_config, "NHD")  # the engine core resolves it
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float16)
    specs = [{"layer.0": spec, "layer.1": spec}]
    page = spec.page_size_bytes * 2
    return worker_kv_cache_configs(vllm_config, specs, [page * 512])


def test_without_the_plugin_vllm_skips_worker_zeroing(restore_vllm: pytest.MonkeyPatch) -> None:
    restore_vllm.delenv("KVGUARD_GUARD", raising=False)
    plugin.register()  # not asked for: changes nothing
    (config,) = _worker_kv_cache_configs()
    assert config.needs_kv_cache_zeroing is False


def test_plugin_makes_the_workers_config_ask_for_zeroing(plugin_on: pytest.MonkeyPatch) -> None:
    configs = _worker_kv_cache_configs()
    for config in configs:
        assert config.needs_kv_cache_zeroing is True
        # Workers receive a pickled copy; the plugin is loaded in their process too.
        assert pickle.loads(pickle.dumps(config)).needs_kv_cache_zeroing is True
        assert settings.stock_needs_zeroing(config) is False
    assert generate_scheduler_kv_cache_config(configs).needs_kv_cache_zeroing is True


def test_plugin_turns_nan_counting_on_and_refuses_it_off(
    restore_vllm: pytest.MonkeyPatch,
) -> None:
    restore_vllm.setenv("KVGUARD_GUARD", "1")
    restore_vllm.delenv("VLLM_COMPUTE_NANS_IN_LOGITS", raising=False)
    plugin.register()
    import os

    assert os.environ["VLLM_COMPUTE_NANS_IN_LOGITS"] == "1"
    restore_vllm.setenv("VLLM_COMPUTE_NANS_IN_LOGITS", "0")
    with pytest.raises(GuardConfigError, match="VLLM_COMPUTE_NANS_IN_LOGITS"):
        plugin.register()


def test_plugin_makes_the_model_runners_count_nans_per_request(
    plugin_on: pytest.MonkeyPatch,
) -> None:
    """In every process vLLM starts: what lets the guard take speculative decoding."""
    assert settings.worker_counts_per_request()
    assert getattr(v2_runner.GPUModelRunner.sample, "_kvguard_per_request_nans", False)
    if has_v1_model_runner():
        import vllm.v1.worker.gpu_model_runner as v1_runner

        v1_model_runner = v1_runner.GPUModelRunner
        assert getattr(v1_model_runner._bookkeeping_sync, "_kvguard_per_request_nans", False)
        assert getattr(v1_runner.count_nans_per_row, "_kvguard_per_request_nans", False)
        assert getattr(v1_model_runner._get_nans_in_logits, "_kvguard_per_request_nans", False)
    # Runner modules a worker imports later are patched as they load.
    assert any(type(f).__name__ == "PatchOnImport" for f in sys.meta_path)
    plugin_on.delenv("KVGUARD_GUARD")
    assert not settings.worker_counts_per_request()


def test_plugin_refuses_an_unsupported_vllm(restore_vllm: pytest.MonkeyPatch) -> None:
    restore_vllm.setenv("KVGUARD_GUARD", "1")
    restore_vllm.setattr(vllm, "__version__", "0.99.1")
    with pytest.raises(UnsupportedVllmError, match=r"vllm==0\.99\.1"):
        plugin.register()


def test_plugin_selects_the_guarded_scheduler_unless_one_was_chosen(
    plugin_on: pytest.MonkeyPatch,
) -> None:
    config = make_vllm_config().scheduler_config
    assert config.get_scheduler_cls() is GuardedScheduler
    config.async_scheduling = True
    assert config.get_scheduler_cls() is GuardedAsyncScheduler
    config.scheduler_cls = "vllm.v1.core.sched.scheduler.Scheduler"
    assert config.get_scheduler_cls() is Scheduler


def test_zero_ids_reach_the_worker_and_are_only_kvguards(plugin_on: pytest.MonkeyPatch) -> None:
    s = make_scheduler(max_num_batched_tokens=BLOCK)
    assert s.needs_kv_cache_zeroing, "vLLM's scheduler would drop new_block_ids_to_zero"
    prompt = list(range(3000, 3000 + 3 * BLOCK))
    s.add_request(make_request("a", prompt))
    so, _ = step(s)
    # Fresh blocks are not zeroed (vLLM would zero every new block once zeroing is on).
    assert so.new_block_ids_to_zero is None
    step(s, {"a": 1})  # a's second chunk fails: its block is quarantined
    s.add_request(make_request("b", prompt))
    so = s.schedule()
    assert so.new_block_ids_to_zero is not None and len(so.new_block_ids_to_zero) == 1


def test_entry_point_is_declared() -> None:
    """pyproject.toml declares the plugin where vLLM looks (installed metadata may be
    stale in a source checkout; the declaration is what ships)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    text = (root / "pyproject.toml").read_text()
    assert '[project.entry-points."vllm.general_plugins"]\n' in text
    assert 'kvguard = "kvguard.adapters.vllm.plugin:register"' in text
    from kvguard.adapters.vllm.plugin import register

    assert register is plugin.register
