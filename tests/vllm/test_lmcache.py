"""LMCache against its real package (``lmcache``, in the vLLM 0.33 lock): vLLM's
``LMCacheConnectorV1`` with LMCache's own scheduler side and worker adapter, stock and
guarded (``GuardedLMCacheConnectorV1``).

LMCache's worker side needs a CUDA device for its copies (it ships no connector for CPU
caches), so the test plays LMCache's *engine* -- the object LMCache's worker adapter
calls to store and retrieve chunks -- in memory, over a model runner's KV caches (CPU
tensors in FLASH_ATTN's layout), with LMCache's own chunk hashes; LMCache's lookups are
answered from the same played store. Everything else is LMCache's and vLLM's code: the
scheduler side that decides what to save and load, the worker adapter that carries it
out (``start_load_kv``, ``wait_for_save``), vLLM's scheduler and kvguard's pool. The
"forward" writes each scheduled token's KV as a function of its prefix and checks the
KV it attends to (``test_sealed_offloading.Engine.forward``).

Stock LMCache saves KV of a step before its NaN count exists, and loads a rotten copy
as a prefix hit. Guarded, a save goes out only once the step validated, a rotten copy
is refused by its seals and recomputed, and LMCache holds the same chunks as stock
after clean runs.

LMCache 0.5.6's adapter does not drive vLLM 0.34 (it reads ``resumed_req_ids``, which
0.34 dropped): on 0.34 only the first step and the refusals run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = [
    pytest.mark.vllm,
    # (lmcache's own imports warn about their dependencies' deprecations.)
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]
pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
pytest.importorskip("lmcache", reason="LMCache's real package (pip install lmcache)")

import lmcache.integration.vllm.utils as lmcache_utils  # noqa: E402
import lmcache.integration.vllm.vllm_v1_adapter as lmcache_adapter  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import (  # noqa: E402
    LMCacheConnectorV1,
)
from vllm.v1.core.sched.output import CachedRequestData  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

from kvguard.adapters.vllm import plugin  # noqa: E402
from kvguard.adapters.vllm.config import GuardConfigError  # noqa: E402
from kvguard.adapters.vllm.exits.gate import LOAD_SEALS  # noqa: E402
from kvguard.adapters.vllm.exits.lmcache import TIER, GuardedLMCacheConnectorV1  # noqa: E402
from kvguard.adapters.vllm.workers import seals as worker_seals  # noqa: E402
from kvguard.adapters.vllm.workers.audit import with_seals  # noqa: E402

from .harness import (  # noqa: E402
    BLOCK,
    LMCacheLookupStub,
    finish_reasons,
    lmcache_hit,
    make_request,
    make_scheduler,
    model_output,
)
from .plugin_patches import undo_plugin_patches_after  # noqa: E402
from .test_sealed_offloading import CORRUPTIONS, caches, runner, true_kv  # noqa: E402

CHUNK = 2 * BLOCK
"""LMCache's chunk: two blocks."""
PROMPT = list(range(300, 300 + 4 * BLOCK + 3))  # 2 chunks and 3 tokens
OTHER = list(range(900, 900 + 4 * BLOCK + 3))  # another prompt of the same shape

DRIVES_THIS_VLLM = "resumed_req_ids" in {f.name for f in dataclasses.fields(CachedRequestData)}
needs_driving = pytest.mark.skipif(
    not DRIVES_THIS_VLLM,
    reason="LMCache 0.5.6's adapter does not drive vLLM 0.34 (no resumed_req_ids)",
)


@pytest.fixture(autouse=True)
def fresh_lmcache_config(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """LMCache keeps one configuration per process and writes each connector's
    ``lmcache.*`` settings into it: every test starts from LMCache's defaults."""
    monkeypatch.setattr(lmcache_utils, "_config_instance", None)
    monkeypatch.setenv("LMCACHE_DISABLE_BANNER", "1")
    yield


def config(guarded: bool, policy: str = "recompute", **extra: object) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="GuardedLMCacheConnectorV1" if guarded else "LMCacheConnectorV1",
        kv_connector_module_path="kvguard.adapters.vllm" if guarded else None,
        kv_role="kv_both",
        kv_connector_extra_config={"lmcache.chunk_size": CHUNK, **extra},
        kv_load_failure_policy=policy,
    )


# ---------------------------------------------------------------- LMCache's engine, played


class PlayedStore:
    """LMCache's engine as its worker adapter and lookup client use it, in memory:
    chunks by LMCache's own chunk hash (``ChunkedTokenDatabase``), each a copy of its
    tokens' KV in every layer."""

    def __init__(self, token_database: Any, kv_caches: list[Any]) -> None:
        self.db = token_database
        self.caches = kv_caches
        self.chunks: dict[int, list[Any]] = {}
        self.token_database = SimpleNamespace(
            process_tokens=token_database.process_tokens, _make_key_by_hash=lambda h: h
        )
        self.storage_manager = SimpleNamespace(remove=self.remove, cancel_request=lambda r: None)
        self.stored: list[int] = []

    def _slots(self, slot_mapping: Any, start: int, stop: int) -> list[tuple[int, int]]:
        return [divmod(int(s), BLOCK) for s in slot_mapping[start:stop]]

    def store(self, tokens: Any, mask: Any, kvcaches: Any, slot_mapping: Any, **_: Any) -> None:
        skip = int((~mask).sum())
        for start, stop, chunk_hash in self.db.process_tokens(list(tokens), make_key=False):
            if start < skip:
                continue
            slots = self._slots(slot_mapping, start, stop)
            self.chunks[chunk_hash] = [
                torch.stack([c[:, b, o].clone() for b, o in slots]) for c in self.caches
            ]
            self.stored.append(chunk_hash)

    def retrieve(self, tokens: Any, mask: Any, kvcaches: Any, slot_mapping: Any, **_: Any) -> Any:
        skip = int((~mask).sum())
        got = torch.zeros(len(tokens), dtype=torch.bool)
        for start, stop, chunk_hash in self.db.process_tokens(list(tokens), make_key=False):
            if start < skip:
                continue
            copy = self.chunks.get(chunk_hash)
            if copy is None:
                break
            for i, (b, o) in enumerate(self._slots(slot_mapping, start, stop)):
                for cache, layer in zip(self.caches, copy, strict=True):
                    cache[:, b, o] = layer[i]
            got[start:stop] = True
        return got

    def lookup(self, token_ids: Any, lookup_id: str = "", request_configs: Any = None) -> int:
        return lmcache_hit(self.db, token_ids, self.chunks)

    def remove(self, key: int, locations: Any = None) -> int:
        return int(self.chunks.pop(key, None) is not None)

    def copy_of(self, prompt: list[int], chunk: int) -> list[Any]:
        """The store's copy of chunk ``chunk`` of ``prompt`` (live)."""
        hashes = [h for _, _, h in self.db.process_tokens(prompt, make_key=False)]
        return self.chunks[hashes[chunk]]

    def lookup_unpin(self, req_id: str) -> None:
        pass

    def get_kv_events(self) -> list[Any]:
        return []


class PlayedLookup(LMCacheLookupStub):
    """LMCache's scheduler-side lookup client, answered from the played store."""

    def __init__(self, store: PlayedStore, token_database: Any) -> None:
        self.store = store
        self.token_database = token_database

    def lookup(self, token_ids: Any, lookup_id: str, request_configs: Any = None) -> int:
        return self.store.lookup(token_ids)


class Engine:
    """A real scheduler (kvguard's or stock vLLM's) with vLLM's LMCache connector, and
    its worker side -- vLLM's connector with LMCache's worker adapter over the played
    engine -- over ``runner()``'s caches."""

    def __init__(
        self,
        guarded: bool,
        monkeypatch: pytest.MonkeyPatch,
        *,
        seal: bool = True,
        policy: str = "recompute",
        async_scheduling: bool = False,
    ) -> None:
        self.runner = runner()
        monkeypatch.setattr(worker_seals, "_process_runner", [self.runner])
        monkeypatch.setattr(
            lmcache_adapter, "get_pp_group", lambda: SimpleNamespace(is_last_rank=True)
        )
        kvguard = {"seal": seal, "check_invariants": True} if guarded else None
        self.s = make_scheduler(
            guarded=guarded,
            kvguard=kvguard,
            kv_transfer_config=config(guarded, policy),
            async_scheduling=async_scheduling,
        )
        impl = self.s.connector._lmcache_engine
        db = impl.lookup_client.token_database
        impl.lookup_client.close()
        self.store = PlayedStore(db, caches(self.runner))
        impl._manager._lookup_client = PlayedLookup(self.store, db)
        cls: Any = GuardedLMCacheConnectorV1 if guarded else LMCacheConnectorV1
        self.worker = cls(self.s.vllm_config, KVConnectorRole.WORKER, self.s.kv_cache_config)
        worker_impl = self.worker._lmcache_engine
        worker_impl.register_kv_caches(
            dict(zip(("layer0", "layer1"), caches(self.runner), strict=True))
        )
        worker_impl._manager._lmcache_engine = self.store
        self.wrong: set[str] = set()
        self.finished: dict[str, str] = {}
        self.refused: list[set[int]] = []
        self.metas: list[Any] = []
        self.preempted = 0
        self.inject: dict[str, int] = {}
        """NaN counts for the next step of these requests (their logits turn out NaN)."""

    def step(self) -> dict[str, str]:
        """One step: the connector's worker-side calls in the order vLLM's model runner
        makes them, around the played forward."""
        s, w = self.s, self.worker
        so = s.schedule()
        meta = so.kv_connector_metadata
        self.metas.append(meta)
        self.preempted += len(so.preempted_req_ids or ())
        w.bind_connector_metadata(meta)
        w.start_load_kv(SimpleNamespace(attn_metadata=object()))
        before = set(self.wrong)
        nans = self._forward(so)
        computed_on = self.wrong - before  # (KV not their own: wrong, unless dropped)
        for req_id in [r for r in self.inject if r in so.num_scheduled_tokens]:
            nans[req_id] = self.inject.pop(req_id)
        out = model_output(s, so, nans)
        blocks = getattr(so, worker_seals.SEAL_FIELD, None)
        if blocks:
            seals = worker_seals.seal_step(self.runner, blocks)
            out.num_nans_in_logits = with_seals(out.num_nans_in_logits, seals)
        w.wait_for_save()
        sending, _ = w.get_finished(set(so.finished_req_ids))
        invalid = set(w.get_block_ids_with_load_errors())
        self.refused.append(invalid)
        out.kv_connector_output = KVConnectorOutput(
            finished_sending=sending or None, invalid_block_ids=invalid
        )
        w.clear_connector_metadata()
        reasons = finish_reasons(s.update_from_output(so, out))
        self.finished.update(reasons)
        # LMCache loads in the step that computes on the KV; a load that failed makes
        # vLLM drop that step's output for the request (recomputed from the first bad
        # block, or failed): computing on it then delivers nothing.
        for req_id, seals in (getattr(meta, LOAD_SEALS, None) or {}).items():
            bad = [i for i, b in enumerate(seals) if b in invalid]
            request = s.requests.get(req_id)
            dropped = request is None or request.num_computed_tokens <= (
                self._first_loaded(meta, req_id) + min(bad, default=0) * BLOCK
            )
            if bad and dropped and reasons.get(req_id) in (None, "error"):
                self.wrong -= {req_id} & computed_on
        return reasons

    @staticmethod
    def _first_loaded(meta: Any, req_id: str) -> int:
        m = next(m for m in meta.requests if m.req_id == req_id)
        return int(m.load_spec.vllm_cached_tokens) // BLOCK * BLOCK

    def _forward(self, so: Any) -> dict[str, int]:
        from .test_sealed_offloading import Engine as OffloadingEngine

        return OffloadingEngine.forward(self, so)  # type: ignore[arg-type]

    def run(self, *requests: Any, steps: int = 100) -> None:
        for request in requests:
            self.s.add_request(request)
        for _ in range(steps):
            if not self.s.requests:
                return
            self.step()
        raise AssertionError("the requests did not finish")

    def hashes(self, prompt: list[int]) -> list[int]:
        return [h for _, _, h in self.store.db.process_tokens(prompt, make_key=False)]

    def holds_true_kv(self, prompt: list[int]) -> list[bool]:
        """Per chunk of ``prompt`` LMCache holds: whether it is the prompt's own KV."""
        out = []
        for c, chunk_hash in enumerate(self.hashes(prompt)):
            copy = self.store.chunks.get(chunk_hash)
            if copy is None:
                continue
            ok = all(
                torch.equal(copy[layer][i], true_kv(prompt, c * CHUNK + i, layer))
                for layer in range(2)
                for i in range(len(copy[layer]))
            )
            out.append(ok)
        return out


# ---------------------------------------------------------------- stores


def test_stock_lmcache_saves_a_step_decided_before_its_nan_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The save of the step that will have NaN logits is already decided when the step
    is scheduled: the workers carry it out during that forward."""
    e = Engine(False, monkeypatch)
    e.s.add_request(make_request("a", PROMPT, max_tokens=2))
    so = e.s.schedule()
    saves = {m.req_id: m.save_spec.can_save for m in so.kv_connector_metadata.requests}
    assert saves == {"a": True}


@needs_driving
def test_a_failed_step_never_reaches_lmcache_stock_saves_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ "a"'s first prefill chunk (64 tokens: LMCache's first two chunks) has NaN logits.
    Stock LMCache saved both chunks during that forward; guarded, the request is
    aborted and LMCache never sees its KV, while "b" beside it is saved."""
    for guarded in (False, True):
        e = Engine(guarded, monkeypatch)
        e.inject["a"] = 1
        e.run(make_request("a", PROMPT, max_tokens=3), make_request("b", OTHER, max_tokens=3))
        saved_a = [h in e.store.chunks for h in e.hashes(PROMPT)]
        if guarded:
            assert saved_a == [False, False]
            assert e.finished["a"] == "error"
            assert e.s.kvguard_stats()["requests_aborted"] == 1
        else:
            assert saved_a == [True, True], "stock saved the failed step's KV"
        assert [h in e.store.chunks for h in e.hashes(OTHER)] == [True, True]


@needs_driving
def test_guarded_saves_what_validated_as_stock_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clean runs: LMCache ends up holding the same chunks, guarded and stock, each the
    prompt's own KV; guarded issues each save a step after the step that wrote it."""
    held = {}
    for guarded in (False, True):
        e = Engine(guarded, monkeypatch)
        e.run(make_request("a", PROMPT, max_tokens=3), make_request("b", OTHER, max_tokens=1))
        assert not e.wrong
        assert e.finished == {"a": "length", "b": "length"}
        held[guarded] = sorted(e.store.chunks)
        assert e.holds_true_kv(PROMPT) == [True, True]
        assert e.holds_true_kv(OTHER) == [True, True]  # (b finished at once: saved after)
        if guarded:
            stats = e.s.kvguard_stats()
            assert stats["lmcache_chunks_stored"] == 4
            first = e.metas[0]
            assert not any(m.save_spec and m.save_spec.can_save for m in first.requests)
            e.s.kvguard_pool.check_consistency()
    assert held[True] == held[False]


@needs_driving
@pytest.mark.parametrize("again", [PROMPT + [7, 8], PROMPT[: 2 * CHUNK]], ids=["longer", "same"])
def test_a_prompt_saved_is_loaded_again_as_stock_loads_it(
    again: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt LMCache holds two chunks of, asked again: loaded, not recomputed, as
    stock loads it (also when the prompt is those two chunks exactly, whose last token
    vLLM recomputes)."""
    for guarded in (False, True):
        e = Engine(guarded, monkeypatch)
        e.run(make_request("a", PROMPT, max_tokens=2))
        assert e.s.reset_prefix_cache()
        e.metas.clear()
        e.run(make_request("again", again, max_tokens=2))
        loads = [
            m.load_spec.lmcache_cached_tokens
            for meta in e.metas
            for m in meta.requests
            if m.load_spec is not None and m.load_spec.can_load
        ]
        assert loads == [2 * CHUNK], guarded
        assert not e.wrong
        if guarded:
            assert LOAD_SEALS in vars(e.metas[0])
            stats = e.s.kvguard_stats()
            assert stats["lmcache_loads_refused"] == 0 and stats["lmcache_hits_cut"] == 0


@needs_driving
def test_preempted_requests_save_only_their_own_validated_kv(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More requests than the 64-block pool holds: vLLM preempts and resumes them (new
    blocks; LMCache starts their saves again from what it holds). Every chunk LMCache
    holds is its prompt's own KV, no request computes on KV not its own, and the pool
    and the gate end consistent, no block held."""
    prompts = [list(range(1000 * k, 1000 * k + 7 * BLOCK + 5)) for k in range(1, 6)]
    e = Engine(True, monkeypatch, seal=False)
    e.run(*(make_request(f"r{k}", p, max_tokens=100) for k, p in enumerate(prompts)), steps=600)
    assert e.preempted > 0
    assert not e.wrong
    assert set(e.finished.values()) == {"length"}
    for p in prompts:
        assert all(e.holds_true_kv(p)) and e.holds_true_kv(p)
    e.s.kvguard_pool.check_consistency()
    assert e.s.kv_cache_manager.block_pool.get_num_free_blocks() == 63
    assert not e.s.connector._kvguard_saves and not e.s.connector._kvguard_requests


@needs_driving
def test_the_gate_forgets_requests_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate's per-request frontiers of finished requests are dropped (amortized):
    a server that runs for weeks keeps a few, not one per request it served."""
    e = Engine(True, monkeypatch, seal=False)
    prompts = [list(range(100 * k, 100 * k + 2 * CHUNK)) for k in range(10, 50)]
    e.run(*(make_request(f"r{k}", p, max_tokens=2) for k, p in enumerate(prompts)), steps=300)
    assert len(e.finished) == 40 and not e.wrong
    assert e.s.connector.kvguard_gate.num_frontiers() <= 16


@needs_driving
def test_a_finished_request_kept_for_its_save_is_released_even_if_it_cannot_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One output token: "b" finishes in the step that prefills it, which validates its
    chunks as it finishes, unsaved: vLLM keeps its blocks for the save. Its first
    block's hash (and those chained after it) is invalidated before the next step: the
    save does not go out, and the workers still report the request done, so vLLM frees
    its blocks."""
    prompt = OTHER[: 2 * CHUNK]
    e = Engine(True, monkeypatch)
    e.s.add_request(make_request("b", prompt, max_tokens=1))
    e.step()
    connector = e.s.connector
    assert e.finished == {"b": "length"} and "b" in e.s.requests
    assert connector._kvguard_saves["b"].finished  # kept for its last save
    e.s.kvguard_invalidate([make_request("probe", prompt).block_hashes[0]])
    e.step()
    assert "b" not in e.s.requests and not connector._kvguard_saves
    assert not [h for h in e.hashes(prompt) if h in e.store.chunks]
    assert e.s.kv_cache_manager.block_pool.get_num_free_blocks() == 63
    e.s.kvguard_pool.check_consistency()


@needs_driving
def test_under_async_scheduling_saves_wait_for_validation_as_well(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's async scheduler (seals off: they need sync scheduling): step N+1 is
    scheduled before step N's output, so a block validates a step later still. The
    "workers" run each step as it is scheduled (no model: the NaN counts are the
    test's). A failed first step reaches LMCache under stock, not guarded; clean
    requests end with the same chunks saved on both sides, and no block held."""
    saved = {}
    for guarded in (False, True):
        e = Engine(guarded, monkeypatch, seal=False, async_scheduling=True)
        s, w = e.s, e.worker
        for request in (
            make_request("bad", PROMPT, max_tokens=4),
            make_request("a", OTHER, max_tokens=4),
            make_request("b", list(range(3000, 3000 + 2 * CHUNK)), max_tokens=1),
        ):
            s.add_request(request)
        in_flight: list[tuple[Any, Any]] = []
        for step in range(60):
            if not s.requests and not in_flight:
                break
            so = s.schedule()
            w.bind_connector_metadata(so.kv_connector_metadata)
            w.start_load_kv(SimpleNamespace(attn_metadata=object()))
            w.wait_for_save()
            sending, _ = w.get_finished(set(so.finished_req_ids))
            w.clear_connector_metadata()
            nans = {"bad": 1} if step == 0 else {}
            out = model_output(
                s, so, {r: n for r, n in nans.items() if r in so.num_scheduled_tokens}
            )
            out.kv_connector_output = KVConnectorOutput(finished_sending=sending or None)
            in_flight.append((so, out))
            # (One step in flight while the next is scheduled; none once idle.)
            while len(in_flight) > (1 if so.total_num_scheduled_tokens else 0):
                e.finished.update(finish_reasons(s.update_from_output(*in_flight.pop(0))))
        else:
            raise AssertionError("the requests did not finish")
        bad_saved = [h in e.store.chunks for h in e.hashes(PROMPT)]
        assert bad_saved == ([False, False] if guarded else [True, True])
        saved[guarded] = {
            h
            for p in (OTHER, list(range(3000, 3000 + 2 * CHUNK)))
            for h in e.hashes(p)
            if h in e.store.chunks
        }
        assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 63
        if guarded:
            assert e.finished["bad"] == "error"
            s.kvguard_pool.check_consistency()
    assert saved[True] == saved[False] and len(saved[True]) == 4


# ---------------------------------------------------------------- the corruption campaign


def campaign(
    guarded: bool, corrupt: Any, monkeypatch: pytest.MonkeyPatch, policy: str = "recompute"
) -> Engine:
    """PROMPT and OTHER run and are saved; the GPU prefix cache is dropped; chunk 1 of
    PROMPT's copy is corrupted; "retry" (PROMPT again) loads it while "bystander" runs."""
    e = Engine(guarded, monkeypatch, policy=policy)
    e.run(make_request("first", PROMPT, max_tokens=2), make_request("other", OTHER, max_tokens=2))
    assert not e.wrong and e.finished == {"first": "length", "other": "length"}
    assert e.s.reset_prefix_cache()
    if corrupt is not None:
        corrupt(_as_block(e.store.copy_of(PROMPT, 1)), _as_block(e.store.copy_of(OTHER, 1)))
    e.finished.clear()
    e.run(
        make_request("retry", PROMPT + [11, 12], max_tokens=3),
        make_request("bystander", list(range(2000, 2000 + 2 * BLOCK + 5)), max_tokens=3),
    )
    return e


def _as_block(copy: list[Any]) -> list[Any]:
    """A chunk copy ([tokens, 2, heads, dim] per layer) seen as the corruptions expect
    a block copy ([2, tokens, heads, dim]): the same memory."""
    return [layer.transpose(0, 1) for layer in copy]


@needs_driving
@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_a_rotten_lmcache_copy_is_refused_on_load_stock_computes_on_it(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    stock = campaign(False, CORRUPTIONS[kind], monkeypatch)
    assert stock.wrong == {"retry"}, "stock loads the rotten copy as a prefix hit"
    assert stock.finished == {"retry": "length", "bystander": "length"}  # a normal 200

    guarded = campaign(True, CORRUPTIONS[kind], monkeypatch)
    assert not guarded.wrong, "guarded: no request computes on KV not its own"
    assert guarded.finished == {"retry": "length", "bystander": "length"}
    stats = guarded.s.kvguard_stats()
    assert stats["lmcache_loads_refused"] == 1
    assert stats["requests_aborted"] == 0  # recomputed (the policy), never failed
    assert sum(map(len, guarded.refused)) >= 1
    # The rotten chunk left LMCache; the chunk before it, which verified, stays.
    assert stats["lmcache_chunks_purged"] == 1
    assert [h in guarded.store.chunks for h in guarded.hashes(PROMPT)] == [True, False]
    assert guarded.holds_true_kv(PROMPT) == [True]
    guarded.s.kvguard_pool.check_consistency()


@needs_driving
def test_a_load_never_rewrites_a_block_vllm_already_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """LMCache retrieves whole chunks: a request with vLLM's prefix hit on block 0 and
    LMCache's on two chunks has chunk 0 -- block 0 included -- written into its blocks,
    over vLLM's cached block 0, which other requests read. A copy rotten there
    corrupts that shared block under stock; guarded, the worker puts vLLM's block back
    (the rest of the load verifies and is used)."""
    for guarded in (False, True):
        e = Engine(guarded, monkeypatch)
        e.run(make_request("first", PROMPT, max_tokens=2))
        assert e.s.reset_prefix_cache()
        e.run(make_request("warm", PROMPT[: BLOCK + 5], max_tokens=2))  # vLLM caches block 0
        e.store.copy_of(PROMPT, 0)[1][3] += 0.5  # in block 0's part of chunk 0
        e.metas.clear()
        e.run(make_request("retry", PROMPT + [11, 12], max_tokens=2))
        loads = [
            (m.load_spec.vllm_cached_tokens, m.load_spec.lmcache_cached_tokens)
            for meta in e.metas
            for m in meta.requests
            if m.load_spec is not None and m.load_spec.can_load
        ]
        assert loads == [(BLOCK, 2 * CHUNK)]
        e.run(make_request("reader", PROMPT[:BLOCK] + [5, 6, 7], max_tokens=2))
        if guarded:
            assert not e.wrong
            assert e.s.kvguard_stats()["lmcache_loads_refused"] == 0
        else:
            assert {"retry", "reader"} <= e.wrong, "stock: vLLM's block 0 was overwritten"


@needs_driving
def test_under_the_fail_policy_the_request_that_loaded_it_fails_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    e = campaign(True, CORRUPTIONS["flipped exponent bit"], monkeypatch, policy="fail")
    assert not e.wrong
    assert e.finished == {"retry": "error", "bystander": "length"}


@needs_driving
def test_a_copy_kvguard_did_not_save_is_recomputed_not_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seals on: LMCache holds PROMPT's chunks, saved by another instance (here: put in
    the store behind the guard's back). The hit is cut: nothing is loaded, nothing
    refused, the request computes its prompt."""
    donor = Engine(False, monkeypatch)
    donor.run(make_request("a", PROMPT, max_tokens=2))
    e = Engine(True, monkeypatch)
    e.store.chunks.update(donor.store.chunks)
    e.run(make_request("again", PROMPT, max_tokens=2))
    assert not e.wrong
    stats = e.s.kvguard_stats()
    assert stats["lmcache_hits_cut"] == 1 and stats["lmcache_loads_refused"] == 0
    assert not any(m.load_spec and m.load_spec.can_load for meta in e.metas for m in meta.requests)


@needs_driving
def test_an_invalidated_hash_leaves_lmcache(monkeypatch: pytest.MonkeyPatch) -> None:
    e = Engine(True, monkeypatch)
    e.run(make_request("a", PROMPT, max_tokens=2))
    hashes = e.hashes(PROMPT)
    assert all(h in e.store.chunks for h in hashes)
    block_hashes = make_request("probe", PROMPT).block_hashes
    report = e.s.kvguard_invalidate([block_hashes[2]])  # chunk 1's first block
    assert report.purged.get(TIER)
    e.run(make_request("next", OTHER, max_tokens=1))  # a step carries the purge
    assert hashes[0] in e.store.chunks and hashes[1] not in e.store.chunks
    assert e.s.kvguard_stats()["lmcache_chunks_purged"] == 1


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "setting", ["use_layerwise", "enable_blending", "enable_async_loading", "enable_pd"]
)
def test_lmcache_modes_kvguard_cannot_gate_are_refused(setting: str) -> None:
    with pytest.raises(GuardConfigError, match=f"LMCache with {setting}"):
        make_scheduler(kv_transfer_config=config(True, "recompute", **{f"lmcache.{setting}": True}))


def test_the_producer_role_is_refused() -> None:
    """As ``kv_producer`` LMCache's workers save every request a step carries, whatever
    the scheduler's metadata asks."""
    producer = config(True)
    producer.kv_role = "kv_producer"
    with pytest.raises(GuardConfigError, match="kv_producer"):
        make_scheduler(kv_transfer_config=producer)


@needs_driving
def test_the_record_of_lmcache_chunks_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """LMCache evicts without telling the scheduler: kvguard keeps a record of at most
    ``record_limit`` chunks, forgetting the oldest (their hits are then cut)."""
    e = Engine(True, monkeypatch)
    e.s.connector._kvguard_record_limit = 2
    e.run(make_request("a", PROMPT, max_tokens=2), make_request("b", OTHER, max_tokens=2))
    gate = e.s.connector.kvguard_gate
    assert len(gate.recorded()) == 2 and e.s.kvguard_stats()["lmcache_chunks_stored"] == 4
    e.s.kvguard_pool.check_consistency()
    assert e.s.reset_prefix_cache()
    e.metas.clear()
    e.run(
        make_request("again", PROMPT + [7], max_tokens=2), make_request("b2", OTHER, max_tokens=2)
    )
    assert not e.wrong
    assert e.s.kvguard_stats()["lmcache_hits_cut"] == 1  # one prompt's records went


def test_vllms_own_class_is_refused_under_the_guard() -> None:
    with pytest.raises(GuardConfigError, match="GuardedLMCacheConnectorV1"):
        make_scheduler(kv_transfer_config=config(False))


def test_the_plugin_gives_the_guarded_class_for_vllms_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``KVGUARD_GUARD=1``: ``kv_connector="LMCacheConnectorV1"`` builds kvguard's class,
    bound to the guarded scheduler's pool."""
    undo_plugin_patches_after(monkeypatch)
    monkeypatch.setenv("KVGUARD_GUARD", "1")
    plugin.register()
    assert KVConnectorFactory.get_connector_class(config(False)) is GuardedLMCacheConnectorV1
    s = make_scheduler(kv_transfer_config=config(False))
    assert type(s.connector) is GuardedLMCacheConnectorV1
    assert s.connector.kvguard_pool() is s.kvguard_pool
    s.connector._lmcache_engine.lookup_client.close()
