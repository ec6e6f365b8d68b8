"""Worker-side NaN counts per request under speculative decoding, on vLLM's real V1
model runner where the series has one (0.32, 0.33; built on CPU: only the model's
forward pass and the slot-mapping kernel are not run; the logits are hand-built with
NaNs in chosen rows), and on the V2 runner's ``sample`` (every series).

vLLM counts NaNs per logits row and reports row i as the i-th request's count; with
draft tokens a request owns several rows, so stock names the wrong requests. kvguard's
plugin patches the runner (``kvguard.adapters.vllm.workers.nans``); these tests run
vLLM's own ``_prepare_inputs`` (which lays the rows out) and ``_bookkeeping_sync``
(which counts and maps them) with the patch in place, sync and async.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
pytest.importorskip("numba")  # vLLM's ngram proposer, built by the V1 runner

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.config import SpeculativeConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import (  # noqa: E402
    ensure_model_parallel_initialized,
    init_distributed_environment,
)
from vllm.v1.outputs import DraftTokenIds, SamplerOutput  # noqa: E402

from kvguard.adapters.vllm._compat import has_v1_model_runner  # noqa: E402
from kvguard.adapters.vllm.workers import nans as worker_nans  # noqa: E402
from kvguard.adapters.vllm.workers import runner_hooks  # noqa: E402

if has_v1_model_runner():
    import vllm.v1.worker.gpu_model_runner as v1
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

needs_v1 = pytest.mark.skipif(
    not has_v1_model_runner(),
    reason="vLLM 0.34 has no V1 model runner (its CPU runners are V2 runners, covered "
    "by test_v2_rejection_sampler_counts_are_summed_per_request)",
)

from .harness import make_request, make_scheduler, model_output  # noqa: E402

NAN = float("nan")
VOCAB = 11


@pytest.fixture
def patched(per_request_nans: None) -> Iterator[None]:
    """The plugin's worker patch (the ``per_request_nans`` fixture), applied twice."""
    worker_nans.install()  # idempotent
    assert getattr(v1.GPUModelRunner._bookkeeping_sync, "_kvguard_per_request_nans", False)
    yield


_DISTRIBUTED = False


def _runner(vllm_config: Any) -> Any:
    """vLLM's V1 model runner on CPU (one rank; the model is never loaded)."""
    global _DISTRIBUTED
    with set_current_vllm_config(vllm_config):
        if not _DISTRIBUTED:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"tcp://127.0.0.1:{port}",
                local_rank=0,
                backend="gloo",
            )
            ensure_model_parallel_initialized(1, 1)
            _DISTRIBUTED = True
        return CPUModelRunner(vllm_config, torch.device("cpu"))


class Step:
    """A guarded scheduler and a V1 runner fed the same scheduler outputs."""

    def __init__(self) -> None:
        spec = SpeculativeConfig(
            method="ngram", num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=2
        )
        self.s = make_scheduler(speculative_config=spec)
        self.runner = _runner(self.s.vllm_config)
        self.runner.kv_cache_config = self.s.kv_cache_config
        # The slot mapping is a Triton kernel (no CPU build); it does not touch logits.
        self.runner.input_batch.block_table.compute_slot_mapping = lambda *a, **k: None
        for i in range(4):
            self.s.add_request(make_request(f"r{i}", list(range(100 + i, 112 + i)), max_tokens=10))
        so = self.s.schedule()  # the whole prompts (48 tokens of the 64 budget)
        self.runner._update_states(so)
        self.s.update_from_output(so, model_output(self.s, so))

    def prepare(self, drafts: dict[str, list[int]]) -> tuple[Any, int]:
        """Schedule a step with these drafts; vLLM's runner lays out its logits rows."""
        if drafts:
            self.s.update_draft_token_ids(DraftTokenIds(list(drafts), list(drafts.values())))
        so = self.s.schedule()
        assert {r: list(d) for r, d in so.scheduled_spec_decode_tokens.items()} == drafts
        self.runner._update_states(so)
        batch = self.runner.input_batch
        scheduled = np.array([so.num_scheduled_tokens[r] for r in batch.req_ids], dtype=np.int32)
        logits_indices, _, _ = self.runner._prepare_inputs(so, scheduled)
        return so, int(logits_indices.shape[0])

    def book(self, so: Any, logits: torch.Tensor) -> tuple[dict[str, int], Any]:
        """vLLM's bookkeeping of the step: the NaN counts it reports (sync), or the
        per-request counts it leaves on the device (async)."""
        batch = self.runner.input_batch
        width = 1 + max((len(d) for d in so.scheduled_spec_decode_tokens.values()), default=0)
        sampled = torch.full((batch.num_reqs, width), -1, dtype=torch.int32)
        sampled[:, 0] = 5
        out = self.runner._bookkeeping_sync(
            so,
            SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=None),
            logits,
            torch.zeros(so.total_num_scheduled_tokens, 4),
            so.total_num_scheduled_tokens,
        )
        return out[0], out[1]


def _logits(num_rows: int, nan_rows: dict[int, int]) -> torch.Tensor:
    """Finite logits with ``n`` NaNs in each row of ``nan_rows`` (row -> n)."""
    logits = torch.randn(num_rows, VOCAB)
    for row, n in nan_rows.items():
        logits[row, :n] = NAN
    return logits


@needs_v1
def test_draft_rows_are_counted_for_the_request_that_owns_them(patched: None) -> None:
    t = Step()
    order = t.runner.input_batch.req_ids
    assert order == ["r0", "r1", "r2", "r3"]
    # r0 drafts 3 tokens (rows 0-3), r1 none (row 4), r2 one (rows 5-6), r3 none (row 7).
    so, num_rows = t.prepare({"r0": [5, 5, 7], "r2": [5]})
    assert num_rows == 8
    # A NaN in r0's third draft row and in r3's row; r1 and r2 are clean.
    counts, device = t.book(so, _logits(num_rows, {2: 2, 7: 1}))
    assert counts == {"r0": 2, "r1": 0, "r2": 0, "r3": 1}
    assert device is None  # sync: read back by vLLM's own path
    # Stock vLLM reads rows 0-3 as r0-r3: it would blame r2 and clear r3.
    stock = v1.nans_to_dict(
        v1.count_nans_per_row.__wrapped__(_logits(num_rows, {2: 2, 7: 1})).tolist(),
        {r: i for i, r in enumerate(order)},
    )
    assert stock == {"r0": 0, "r1": 0, "r2": 2, "r3": 0}


@needs_v1
def test_async_counts_stay_on_the_device_per_request(patched: None) -> None:
    t = Step()
    t.runner.use_async_scheduling = True
    t.runner.input_batch.prev_sampled_token_ids = torch.zeros(4, 1, dtype=torch.int32)
    so, num_rows = t.prepare({"r1": [5, 5], "r3": [9]})
    assert num_rows == 7  # r0: 0, r1: 1-3, r2: 4, r3: 5-6
    counts, device = t.book(so, _logits(num_rows, {3: 1, 6: 4}))
    assert counts == {}  # the async path maps them when the output is read
    assert device.tolist() == [0, 1, 0, 4]
    # AsyncGPUModelRunnerOutput maps the device counts by request index, as here.
    assert v1.nans_to_dict(device.tolist(), t.runner.input_batch.req_id_to_index) == {
        "r0": 0,
        "r1": 1,
        "r2": 0,
        "r3": 4,
    }


@needs_v1
def test_a_step_without_drafts_runs_vllms_count(patched: None) -> None:
    t = Step()
    so, num_rows = t.prepare({})
    assert num_rows == 4
    counts, _ = t.book(so, _logits(num_rows, {1: 3}))
    assert counts == {"r0": 0, "r1": 3, "r2": 0, "r3": 0}


@needs_v1
def test_a_clean_step_is_told_by_one_sum(patched: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sync path first sums the step's logits (a NaN anywhere makes the sum NaN): a
    clean step reports 0 for every request, what vLLM's count reports, without counting
    rows. A sum that is NaN with no NaN logit (an inf meeting a -inf) counts the rows."""
    t = Step()
    so, num_rows = t.prepare({"r0": [5, 5], "r2": [7]})
    clean = _logits(num_rows, {})
    stock = v1.GPUModelRunner._get_nans_in_logits.__wrapped__(t.runner, clean)
    assert stock == {"r0": 0, "r1": 0, "r2": 0, "r3": 0}

    def count_nans_per_row(logits: torch.Tensor) -> torch.Tensor:
        raise AssertionError("a clean step counted its rows")

    with monkeypatch.context() as m:
        m.setattr(v1, "count_nans_per_row", count_nans_per_row)
        counts, _ = t.book(so, clean)
    assert counts == stock and list(counts) == list(stock)  # the same keys, in order
    infinite = clean.clone()
    infinite[0, 0], infinite[5, 3] = float("inf"), float("-inf")
    assert infinite.sum().isnan()
    assert t.runner._get_nans_in_logits(infinite) == stock
    infinite[3, 1] = NAN  # row 3 is r3's outside a booking (vLLM's row i -> request i)
    assert t.runner._get_nans_in_logits(infinite) == {"r0": 0, "r1": 0, "r2": 0, "r3": 1}


@needs_v1
def test_logits_of_an_unknown_layout_fail_every_request(patched: None) -> None:
    """Rows that do not match the layout vLLM planned cannot be told apart: each request
    gets the whole step's count (the safe side), never a clean zero it may not have."""
    t = Step()
    so, num_rows = t.prepare({"r0": [5]})
    counts, _ = t.book(so, _logits(num_rows + 1, {num_rows: 1}))
    assert counts == {"r0": 1, "r1": 1, "r2": 1, "r3": 1}


def test_row_layout_follows_the_input_batch_order() -> None:
    layout = worker_nans.v1_row_layout
    index = {"a": 2, "b": 0, "c": 1}
    assert layout(index, 3, {"a": [1, 2], "b": [3]}, 6) == [0, 2, 3, 6]
    assert layout(index, 3, {}, 3) == [0, 1, 2, 3]
    assert layout(index, 3, {"a": [1]}, 5) is None  # rows do not match
    assert layout(index, 3, {"x": [1]}, 4) is None  # a request not in the batch


class _V2Batch:
    """The fields of V2's ``InputBatch`` the patch reads (V2's runner needs a GPU)."""

    def __init__(self, cu_num_logits: list[int]) -> None:
        self.num_reqs = len(cu_num_logits) - 1
        self.cu_num_logits = torch.tensor(cu_num_logits, dtype=torch.int32)
        self.num_draft_tokens = cu_num_logits[-1] - self.num_reqs


@pytest.mark.parametrize("which", ["V2", "CPU"])
@pytest.mark.parametrize("sharded", [False, True], ids=["one-rank", "sharded"])
def test_v2_rejection_sampler_counts_are_summed_per_request(
    sharded: bool, which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """V2's ``sample`` returns the rejection sampler's per-row counts; the patch sums
    them with the batch's ``cu_num_logits``, unless the sampler is sharded (vLLM's
    gather then sums per request itself). V2's runner cannot be built without a GPU:
    its ``sample`` is stood in for by one returning vLLM's ``SamplerOutput``."""
    import vllm.v1.worker.gpu.model_runner as v2
    from vllm.v1.worker.gpu.sample.output import SamplerOutput as V2SamplerOutput

    if which == "CPU":  # 0.34's standalone CPU runner: V2's sample, no batch_sharder
        if sharded:
            pytest.skip("the standalone CPU runner does not shard its sampler")
        cpu = pytest.importorskip(
            worker_nans.CPU_RUNNER, reason="vLLM's standalone CPU runner comes with 0.34"
        )
        runner_class = cpu.StandaloneCPUModelRunner
    else:
        runner_class = v2.GPUModelRunner
    logits = _logits(7, {1: 1, 3: 2, 6: 5})
    per_row = logits.isnan().sum(dim=-1, dtype=torch.int32)  # what V2's get_num_nans gives

    def stock_sample(self: Any, hidden_states: Any, input_batch: Any, grammar: Any) -> Any:
        out = V2SamplerOutput(
            sampled_token_ids=torch.zeros(input_batch.num_reqs, 4, dtype=torch.int32),
            logprobs_tensors=None,
            num_nans=per_row.clone(),
            num_sampled=torch.ones(input_batch.num_reqs, dtype=torch.int32),
            num_rejected=torch.zeros(input_batch.num_reqs, dtype=torch.int32),
        )
        return out, out.num_sampled, out.num_rejected

    monkeypatch.setattr(runner_class, "sample", stock_sample)
    worker_nans.install()
    worker_nans.install()
    state = {"batch_sharder": object() if sharded else None} if which == "V2" else {}
    runner = type("Runner", (), state)()
    # Requests own rows 0-3 (3 drafts), 4 (none) and 5-6 (1 draft).
    out, _, _ = runner_class.sample(runner, None, _V2Batch([0, 4, 5, 7]), None)
    assert out.num_nans.tolist() == (per_row.tolist() if sharded else [3, 0, 5])
    # No drafts: one row per request, the counts as vLLM took them.
    out, _, _ = runner_class.sample(runner, None, _V2Batch(list(range(8))), None)
    assert out.num_nans.tolist() == per_row.tolist()


def test_a_runner_module_imported_later_is_patched_on_import(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers import their model runner after vLLM loaded the plugin: the patch is
    applied as the module is executed, once, with vLLM's code left reachable."""
    import importlib
    import sys

    (tmp_path / "kvguard_probe_runner.py").write_text("def count():\n    return 'stock'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    patched: list[str] = []

    def patch(module: Any) -> None:
        patched.append(module.__name__)
        module.count = lambda: "patched"

    finder = runner_hooks.PatchOnImport({"kvguard_probe_runner": patch})
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    module = importlib.import_module("kvguard_probe_runner")
    try:
        assert module.count() == "patched" and patched == ["kvguard_probe_runner"]
        importlib.import_module("kvguard_probe_runner")  # cached: not patched again
        assert patched == ["kvguard_probe_runner"]
        # Other modules import as usual.
        assert importlib.import_module("colorsys").rgb_to_hls(0, 0, 0) == (0, 0, 0)
    finally:
        del sys.modules["kvguard_probe_runner"]


def test_two_hooks_for_one_module_both_patch_it_once(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The NaN counting and the slot wipe hook the same runner modules: the import runs
    both patches, once each, in hook order (a hook asking the other would recurse)."""
    import importlib
    import sys

    (tmp_path / "kvguard_probe_runner2.py").write_text("steps = []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = runner_hooks.PatchOnImport({"kvguard_probe_runner2": lambda m: m.steps.append(1)})
    second = runner_hooks.PatchOnImport({"kvguard_probe_runner2": lambda m: m.steps.append(2)})
    monkeypatch.setattr(sys, "meta_path", [first, second, *sys.meta_path])
    try:
        assert importlib.import_module("kvguard_probe_runner2").steps == [1, 2]
    finally:
        del sys.modules["kvguard_probe_runner2"]
