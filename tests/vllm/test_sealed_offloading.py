"""Sealed CPU offloading: a copy that rotted in vLLM's CPU tier is refused when it is
loaded, stock vLLM beside it.

vLLM's CPU offloading workers need a GPU; here the test plays them with the guarded
connector's real worker side (``GuardedOffloadingConnectorWorker``) over an in-memory
transfer engine: stores copy GPU blocks of a model runner's KV caches (CPU tensors in
FLASH_ATTN's layout) into a CPU tier, loads copy them back, and a "forward" writes each
scheduled token's KV as a function of its prefix -- so the test knows, at every step,
whether a request computes on the KV of its own prefix. The scheduler side is vLLM's,
with kvguard's pool and gate. Each corruption is injected into the CPU tier's copy of
one chunk of a finished request; a later request with the same prompt loads it.

Stock vLLM loads every corrupted copy as a prefix hit and computes on it (a wrong
answer, reported as a normal completion). Guarded, with seals on, refuses each load:
vLLM's ``kv_load_failure_policy`` (``recompute`` here) recomputes the request from the
rotten block, the chunk leaves the tier, and a bystander running beside it is not
touched.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

import vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker as offload_worker  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: E402
    OffloadingConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (  # noqa: E402
    SimpleCPUOffloadConnector,
)
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

from kvguard.adapters.vllm.config import GuardConfigError  # noqa: E402
from kvguard.adapters.vllm.exits.gate import LOAD_SEALS  # noqa: E402
from kvguard.adapters.vllm.exits.offloading import TIER, GuardedOffloadingConnector  # noqa: E402
from kvguard.adapters.vllm.exits.simple_cpu import GuardedSimpleCPUOffloadConnector  # noqa: E402
from kvguard.adapters.vllm.workers import seals as worker_seals  # noqa: E402
from kvguard.adapters.vllm.workers.audit import with_seals  # noqa: E402

from .harness import (  # noqa: E402
    BLOCK,
    finish_reasons,
    make_request,
    make_scheduler,
    model_output,
    offloading_metadata,
    transfer_config,
)
from .test_offloading import kvguard_hash  # noqa: E402

NUM_BLOCKS, HEADS, DIM = 64, 2, 4
PROMPT = list(range(300, 300 + 4 * BLOCK + 3))  # 4 full blocks and 3 tokens
OTHER = list(range(900, 900 + 4 * BLOCK + 3))  # another prompt of the same shape


# ---------------------------------------------------------------- the played workers


def runner() -> Any:
    """What the workers' seals read of a model runner: two layers' KV caches in
    FLASH_ATTN's layout, [2, blocks, block size, heads, head dim], sentinel-filled."""
    context = {
        f"layer{i}": SimpleNamespace(
            kv_cache=torch.full((2, NUM_BLOCKS, BLOCK, HEADS, DIM), -7.0 - i)
        )
        for i in range(2)
    }
    group = SimpleNamespace(
        backend=SimpleNamespace(get_name=lambda: "FLASH_ATTN"), layer_names=list(context)
    )
    return SimpleNamespace(
        attn_groups=[[group]],
        compilation_config=SimpleNamespace(static_forward_context=context),
        kv_cache_config=SimpleNamespace(num_blocks=NUM_BLOCKS),
        model_config=SimpleNamespace(model="tiny"),
    )


def caches(r: Any) -> list[Any]:
    return [layer.kv_cache for layer in r.compilation_config.static_forward_context.values()]


def true_kv(tokens: list[int], position: int, layer: int) -> Any:
    """The KV the model writes for the token at ``position``: a function of its prefix."""
    h = 0
    for token in tokens[: position + 1]:
        h = (h * 31 + token) % 1_000_003
    base = h / 1000.0 + layer
    return base + torch.arange(2 * HEADS * DIM, dtype=torch.float32).reshape(2, HEADS, DIM) / 8


class Transfers:
    """vLLM's offloading worker engine, played in memory: each job runs when submitted
    and is reported finished at the next ``get_finished``. ``tier``: CPU block id -> a
    copy of the GPU block's bytes in every layer."""

    def __init__(self, r: Any) -> None:
        self.caches = caches(r)
        self.tier: dict[int, list[Any]] = {}
        self.done: list[int] = []

    def submit_store(self, job_id: int, src: Any, dst: Any) -> bool:
        for gpu, cpu in zip(src.block_ids, dst.block_ids, strict=True):
            self.tier[int(cpu)] = [c[:, int(gpu)].clone() for c in self.caches]
        self.done.append(job_id)
        return True

    def submit_load(self, job_id: int, src: Any, dst: Any, expedited: bool = False) -> bool:
        for cpu, gpu in zip(src.block_ids, dst.block_ids, strict=True):
            for c, block in zip(self.caches, self.tier[int(cpu)], strict=True):
                c[:, int(gpu)] = block
        self.done.append(job_id)
        return True

    def wait(self, job_ids: Any) -> None:
        pass

    def get_finished(self) -> list[Any]:
        done, self.done = self.done, []
        return [
            SimpleNamespace(job_id=j, success=True, transfer_time=None, transfer_size=None)
            for j in done
        ]


class SimpleTransfers:
    """SimpleCPU's worker handler (``SimpleCPUOffloadWorker``), played in memory as
    :class:`Transfers` plays the offloading engine: a step's load event runs in
    ``start_load_kv`` and its store event in ``wait_for_save``; both are reported done
    in that step's output."""

    def __init__(self, r: Any) -> None:
        self.caches = caches(r)
        self.tier: dict[int, list[Any]] = {}
        self.meta: Any = None
        self._pending_load_event_indices: set[int] = set()
        self.stored: dict[int, int] = {}

    def bind_connector_metadata(self, meta: Any) -> None:
        self.meta = meta
        if meta.load_event >= 0:
            self._pending_load_event_indices.add(meta.load_event)

    def clear_connector_metadata(self) -> None:
        self.meta = None

    def handle_preemptions(self, meta: Any) -> None:
        pass

    def start_load_kv(self) -> None:
        meta = self.meta
        for cpu, gpu in zip(meta.load_cpu_blocks, meta.load_gpu_blocks, strict=True):
            for c, block in zip(self.caches, self.tier[cpu], strict=True):
                c[:, gpu] = block

    def wait_for_save(self) -> None:
        meta = self.meta
        for gpu, cpu in zip(meta.store_gpu_blocks, meta.store_cpu_blocks, strict=True):
            self.tier[cpu] = [c[:, gpu].clone() for c in self.caches]
        if meta.store_event >= 0:
            self.stored[meta.store_event] = 1

    def get_finished(self, finished_req_ids: set[str]) -> tuple[None, set[str] | None]:
        done = self._pending_load_event_indices
        recved = {r for e in done for r in self.meta.load_event_to_reqs.get(e, ())}
        done.clear()
        return None, recved or None

    def build_connector_worker_meta(self) -> Any:
        from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

        stored, self.stored = self.stored, {}
        return SimpleCPUOffloadWorkerMetadata(completed_store_events=stored) if stored else None


class Engine:
    """A real scheduler (kvguard's or stock vLLM's) with a CPU tier -- vLLM's
    offloading connector (``tier="offloading"``) or SimpleCPU's -- and its workers
    played over ``runner()``'s caches."""

    def __init__(
        self,
        guarded: bool,
        monkeypatch: pytest.MonkeyPatch,
        tier: str = "offloading",
        policy: str = "recompute",
    ) -> None:
        self.runner = runner()
        monkeypatch.setattr(worker_seals, "_process_runner", [self.runner])
        self.guarded = guarded
        self.tier = tier
        kvguard = {"seal": True} if guarded else None
        if tier == "simple-cpu":
            from .test_simple_cpu_offloading import simple_cpu_scheduler

            self.s = simple_cpu_scheduler(
                guarded=guarded, kvguard=kvguard, num_blocks=NUM_BLOCKS, cpu_blocks=64
            )
            self.s.vllm_config.kv_transfer_config.kv_load_failure_policy = policy
            self.s.recompute_kv_load_failures = policy == "recompute"
            cls: Any = GuardedSimpleCPUOffloadConnector if guarded else SimpleCPUOffloadConnector
            self.connector = cls(self.s.vllm_config, KVConnectorRole.WORKER, self.s.kv_cache_config)
            self.transfers: Any = SimpleTransfers(self.runner)
            self.connector.worker_handler = self.transfers
        else:
            connector = "GuardedOffloadingConnector" if guarded else "OffloadingConnector"
            self.s = make_scheduler(
                guarded=guarded,
                kvguard=kvguard,
                kv_transfer_config=transfer_config(connector, load_failure_policy=policy),
            )
            # (0.34's workers hand the engine device pointers; the played one takes specs.)
            if hasattr(offload_worker, "resolve_device_pointers"):
                monkeypatch.setattr(offload_worker, "resolve_device_pointers", lambda spec, _: spec)
            cls = GuardedOffloadingConnector if guarded else OffloadingConnector
            self.connector = cls(self.s.vllm_config, KVConnectorRole.WORKER, self.s.kv_cache_config)
            self.transfers = Transfers(self.runner)
            self.connector.connector_worker.worker = self.transfers
            self.connector.connector_worker._kv_caches = None
        self.wrong: set[str] = set()
        self.finished: dict[str, str] = {}
        self.refused: list[set[int]] = []

    def forward(self, so: Any) -> dict[str, int]:
        """Write each scheduled token's KV; a request computing on KV other than its
        prefix's is answered wrongly; one whose KV holds NaN gets a NaN count."""
        nans: dict[str, int] = {}
        layers = caches(self.runner)
        for req_id, n in so.num_scheduled_tokens.items():
            request = self.s.requests[req_id]
            tokens = list(request.all_token_ids)
            end = request.num_computed_tokens  # (vLLM counts the step as computed)
            start = end - n
            (blocks,) = self.s.kv_cache_manager.get_block_ids(req_id)
            for position in range(end):
                block, slot = blocks[position // BLOCK], position % BLOCK
                for layer, cache in enumerate(layers):
                    if position >= start:
                        cache[:, block, slot] = true_kv(tokens, position, layer)
                    elif not torch.equal(cache[:, block, slot], true_kv(tokens, position, layer)):
                        self.wrong.add(req_id)
                    if cache[:, block, slot].isnan().any():
                        nans[req_id] = 1
        return nans

    def step(self) -> dict[str, str]:
        """One step: the connector's worker-side calls in the order vLLM's model runner
        makes them, around the played forward."""
        s, connector = self.s, self.connector
        so = s.schedule()
        meta = so.kv_connector_metadata
        connector.bind_connector_metadata(meta)
        if self.tier == "offloading":
            worker = connector.connector_worker
            if hasattr(worker, "handle_preemptions"):
                worker.handle_preemptions(meta)
            worker.start_kv_transfers(meta)
        else:
            connector.start_load_kv(None)
        nans = self.forward(so)
        out = model_output(s, so, nans)
        blocks = getattr(so, worker_seals.SEAL_FIELD, None)
        if blocks:
            seals = worker_seals.seal_step(self.runner, blocks)
            out.num_nans_in_logits = with_seals(out.num_nans_in_logits, seals)
        connector.wait_for_save()
        _, recved = connector.get_finished(set())
        invalid = set(connector.get_block_ids_with_load_errors())
        self.refused.append(invalid)
        out.kv_connector_output = KVConnectorOutput(
            finished_recving=recved or None,
            invalid_block_ids=invalid,
            kv_connector_worker_meta=connector.build_connector_worker_meta(),
        )
        connector.clear_connector_metadata()
        reasons = finish_reasons(s.update_from_output(so, out))
        self.finished.update(reasons)
        return reasons

    def run(self, *requests: Any) -> None:
        for request in requests:
            self.s.add_request(request)
        for _ in range(100):
            if not self.s.requests and not self.in_flight():
                return
            self.step()
        raise AssertionError("the requests did not finish")

    def in_flight(self) -> bool:
        """Whether a copy is still in flight (its completion not yet reported)."""
        if self.tier == "offloading":
            return bool(self.s.connector.connector_scheduler._jobs)
        return bool(self.s.connector.scheduler_manager._store_event_to_blocks)

    def tier_copy(self, prompt: list[int], index: int) -> list[Any]:
        """The CPU tier's copy of block ``index`` of ``prompt`` (its bytes, live)."""
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
        from vllm.v1.kv_offload.base import ReqContext, make_offload_key

        block_hash = make_request("probe", prompt).block_hashes[index]
        if self.tier == "simple-cpu":
            cpu_pool = self.s.connector.scheduler_manager.cpu_block_pool
            hit = cpu_pool.cached_block_hash_to_block.get_one_block(
                make_block_hash_with_group_id(block_hash, 0)
            )
            return self.transfers.tier[hit.block_id]
        manager = self.s.connector.connector_scheduler.manager
        key = make_offload_key(block_hash, 0)
        spec = manager.prepare_load([key], ReqContext(req_id="probe"))
        manager.complete_load([key], ReqContext(req_id="probe"))
        (cpu,) = spec.block_ids
        return self.transfers.tier[int(cpu)]


# ---------------------------------------------------------------- the corruptions


def overwrite(copy: list[Any], other: list[Any]) -> None:
    copy[1][0, 3, 1, 2] = 123.25  # one finite value in layer 1's K


def flip_sign(copy: list[Any], other: list[Any]) -> None:
    copy[0][1, 5, 0, 0] = -copy[0][1, 5, 0, 0]


def flip_exponent(copy: list[Any], other: list[Any]) -> None:
    word = copy[0][0, 7, 1, 3:4].view(torch.int32)
    word ^= 1 << 23  # the exponent's lowest bit: the value doubles or halves


def nan_words(copy: list[Any], other: list[Any]) -> None:
    copy[1][1, 2, 0, 1] = float("nan")


def another_prefix(copy: list[Any], other: list[Any]) -> None:
    for mine, theirs in zip(copy, other, strict=True):
        mine.copy_(theirs)  # OTHER's block filed under PROMPT's key


def stale_zeros(copy: list[Any], other: list[Any]) -> None:
    for mine in copy:
        mine.zero_()  # memory the copy never reached


CORRUPTIONS: dict[str, Callable[[list[Any], list[Any]], None]] = {
    "overwritten value": overwrite,
    "flipped sign bit": flip_sign,
    "flipped exponent bit": flip_exponent,
    "NaN words": nan_words,
    "another prefix's copy": another_prefix,
    "stale (zeroed) copy": stale_zeros,
}


TIERS = pytest.mark.parametrize("tier", ["offloading", "simple-cpu"])


def campaign(
    guarded: bool,
    corrupt: Any,
    monkeypatch: pytest.MonkeyPatch,
    tier: str = "offloading",
    policy: str = "recompute",
) -> Engine:
    """PROMPT and OTHER run and are stored; the GPU prefix cache is dropped; block 2 of
    PROMPT's copy is corrupted; "retry" (PROMPT again) loads it while "bystander" runs."""
    e = Engine(guarded, monkeypatch, tier, policy)
    e.run(make_request("first", PROMPT, max_tokens=2), make_request("other", OTHER, max_tokens=2))
    assert not e.wrong and e.finished == {"first": "length", "other": "length"}
    assert e.s.reset_prefix_cache()
    if corrupt is not None:
        corrupt(e.tier_copy(PROMPT, 2), e.tier_copy(OTHER, 2))
    e.finished.clear()
    e.run(
        make_request("retry", PROMPT + [11, 12], max_tokens=3),
        make_request("bystander", list(range(2000, 2000 + 2 * BLOCK + 5)), max_tokens=3),
    )
    return e


@TIERS
@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_a_rotten_cpu_copy_is_refused_on_load_stock_computes_on_it(
    kind: str, tier: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    stock = campaign(False, CORRUPTIONS[kind], monkeypatch, tier)
    assert stock.wrong == {"retry"}, "stock loads the rotten copy as a prefix hit"
    assert stock.finished == {"retry": "length", "bystander": "length"}  # a normal 200

    guarded = campaign(True, CORRUPTIONS[kind], monkeypatch, tier)
    assert not guarded.wrong, "guarded: no request computes on KV not its own"
    assert guarded.finished == {"retry": "length", "bystander": "length"}
    stats = guarded.s.kvguard_stats()
    assert stats["offload_loads_refused"] == 1
    assert stats["requests_aborted"] == 0  # recomputed (the policy), never failed
    # The refused load named the rotten block; its chunk and the load's later chunk
    # left the tier (and were stored again, sealed, from the recomputed KV).
    assert sum(map(len, guarded.refused)) == 1
    assert stats["offload_chunks_purged"] == 2
    guarded.s.kvguard_pool.check_consistency()


@TIERS
def test_under_the_fail_policy_the_request_that_loaded_it_fails_alone(
    tier: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kv_load_failure_policy="fail"``: the request whose load was refused ends with
    an error -- no wrong answer -- and the bystander completes."""
    e = campaign(True, flip_exponent, monkeypatch, tier, policy="fail")
    assert not e.wrong
    assert e.finished == {"retry": "error", "bystander": "length"}
    assert e.s.kvguard_stats()["offload_loads_refused"] == 1
    e.s.kvguard_pool.check_consistency()


@TIERS
def test_an_intact_copy_loads_and_verifies(tier: str, monkeypatch: pytest.MonkeyPatch) -> None:
    e = campaign(True, None, monkeypatch, tier)
    assert not e.wrong and e.finished == {"retry": "length", "bystander": "length"}
    stats = e.s.kvguard_stats()
    assert stats["offload_loads_refused"] == 0 and not any(e.refused)
    assert e.s.requests == {}
    # The load was a hit: retry computed only what followed the 4 loaded blocks.
    assert stats["blocks_sealed"] > 0


def test_load_jobs_carry_their_blocks_seals(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each GPU block a load fills is sent with the seal the tier's copy of the
    request's block at that position carries (taken when its step validated)."""
    e = Engine(True, monkeypatch)
    e.run(make_request("first", PROMPT, max_tokens=2))
    core = e.s.kvguard_pool.core
    assert e.s.reset_prefix_cache()
    e.s.add_request(make_request("retry", PROMPT, max_tokens=2))
    meta = offloading_metadata(e.s.schedule())
    ((job_id, job),) = meta.load_jobs.items()
    dst = [int(b) for b in job.dst_spec.block_ids]
    want = {b: core.tier_seal(kvguard_hash(PROMPT, i), TIER) for i, b in enumerate(dst)}
    assert getattr(meta, LOAD_SEALS) == {job_id: want}
    assert None not in want.values() and len(set(want.values())) == 4


def test_seals_refuse_a_model_with_several_kv_cache_groups() -> None:
    with pytest.raises(GuardConfigError, match="one KV cache group"):
        make_scheduler(
            kvguard={"seal": True},
            groups=("full", "sliding"),
            kv_transfer_config=transfer_config(),
        )
