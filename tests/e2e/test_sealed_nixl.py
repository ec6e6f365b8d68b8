"""Sealed prefill/decode handoffs over NIXL on real engines: what a decode instance reads
is verified by the seals the prefill instance took when the prompt's step validated.

As in ``test_nixl.py``: two CPU engines on loopback, vLLM's ``NixlConnector`` moving KV
between their caches over UCX. The prefill instance is guarded with seals on
(``KVGUARD_SEAL=1``): the transfer parameters it hands the client carry the seals of
the blocks it hands over (``kvguard_seals``). Between the prefill and the read, the
test corrupts the prefill instance's copy of those blocks in its worker (the bytes a
decode instance will read: what a rotten link, a stale or a wrong registration would
deliver). A stock decode instance reads the corrupted KV as a prefix hit and decodes
from it; a guarded decode instance with seals on verifies the read, reports the blocks
that do not give their seals as failed loads, and -- ``kv_load_failure_policy``
``recompute`` -- computes the prompt itself: the fault-free output.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import HAVE_ENGINE
from .test_nixl import pytestmark  # noqa: F401 (the same marks: an engine, NIXL)

if HAVE_ENGINE:
    from .conftest import shutdown
    from .engine import Result, connector_engine, generate, set_faults, tokens
    from .test_nixl import PROMPT, TO_DECODE, _free_port, _run, _to_decode


def _engine(model_dir: str, guard: bool, role: str, log: Any, seal: bool) -> Any:
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(
        kv_connector="NixlConnector",
        kv_role=role,
        kv_buffer_device="cpu",
        kv_load_failure_policy="recompute",
    )
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port()),
        "KVGUARD_SEAL": "1" if seal else "0",
    }
    return connector_engine(model_dir, guard, config, log, env)


@pytest.fixture(scope="module")
def instances(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A sealed prefill instance, a stock and a sealed decode instance, faults off."""
    logs = tmp_path_factory.mktemp("sealed-nixl-logs")
    built: dict[str, Any] = {}
    try:
        for name, guard, role in [
            ("prefill", True, "kv_producer"),
            ("decode-stock", False, "kv_consumer"),
            ("decode-sealed", True, "kv_consumer"),
        ]:
            built[name] = _engine(model_dir, guard, role, logs / f"{name}.log", seal=guard)
            set_faults(built[name], False)
        built["logs"] = logs
        yield built
    finally:
        for name, llm in built.items():
            if name != "logs":
                shutdown(llm)


# Functions the prefill instance's worker runs (collective_rpc): module-level.


def corrupt_blocks(worker: Any, block_ids: list[int], kind: str) -> int:
    """In the worker: alter every layer's KV of ``block_ids``; returns the layers."""
    import torch

    caches = worker.model_runner.kv_caches
    index = torch.tensor(block_ids, dtype=torch.long)
    generator = torch.Generator().manual_seed(7)
    for cache in caches:
        if kind == "noise":
            part = cache.index_select(0, index)
            noise = torch.randn(part.shape, generator=generator).to(cache.dtype) * 4
            cache.index_copy_(0, index, noise)
        elif kind == "one bit":
            word = cache[block_ids[0]].flatten()[:1]
            bits = word.view(torch.int16 if cache.element_size() == 2 else torch.int32)
            bits ^= 1 << (7 if cache.element_size() == 2 else 23)  # the exponent's low bit
            break  # one value in one layer
    return len(caches)


def _stats(llm: Any) -> dict[str, int]:
    return dict(llm.llm_engine.engine_core.call_utility("kvguard_stats"))


def _handed(instances: dict[str, Any], prompt: list[int], kind: str | None) -> dict[str, Any]:
    """The prefill instance computes ``prompt`` for one token; its handed-over blocks
    are corrupted (``kind``; None: left intact). The parameters the proxy forwards."""
    ((first, params),) = _run(instances["prefill"], [prompt], [TO_DECODE], 1)
    assert first.finish_reason == "length" and params is not None
    seals = params["kvguard_seals"]
    (blocks,) = params["remote_block_ids"]
    (group_seals,) = seals
    assert len(group_seals) == len(blocks)
    assert None not in group_seals[:-1], "every full block handed over carries its seal"
    if kind is not None:
        instances["prefill"].collective_rpc(corrupt_blocks, args=(list(blocks[:-1]), kind))
    return _to_decode(params)


def test_a_sealed_handoff_is_read_and_verified(instances: dict[str, Any], reference: Any) -> None:
    prompt = tokens(211, PROMPT)
    (want,) = generate(reference, [prompt], max_tokens=8)
    before = _stats(instances["decode-sealed"])["handoffs_refused"]
    params = _handed(instances, prompt, None)
    ((decoded, _),) = _run(instances["decode-sealed"], [prompt], [params], 8)
    assert decoded == Result(want.token_ids, "length", PROMPT)  # read over NIXL
    assert _stats(instances["decode-sealed"])["handoffs_refused"] == before


@pytest.mark.parametrize("kind", ["noise", "one bit"])
def test_a_corrupted_handoff_is_refused_by_its_seals_stock_decodes_from_it(
    kind: str, instances: dict[str, Any], reference: Any
) -> None:
    seed = {"noise": 221, "one bit": 231}[kind]
    stock_prompt, sealed_prompt = tokens(seed, PROMPT), tokens(seed + 1, PROMPT)
    want = generate(reference, [stock_prompt, sealed_prompt], max_tokens=8)

    # Stock: the corrupted KV is read as a prefix hit of the whole prompt.
    params = _handed(instances, stock_prompt, kind)
    ((stock, _),) = _run(instances["decode-stock"], [stock_prompt], [params], 8)
    assert stock.num_cached_tokens == PROMPT and stock.finish_reason == "length"
    if kind == "noise":
        assert stock.token_ids != want[0].token_ids, "stock decodes from the corrupted KV"

    # Sealed: the read does not verify; the prompt is recomputed, the output right.
    before = _stats(instances["decode-sealed"])["handoffs_refused"]
    params = _handed(instances, sealed_prompt, kind)
    ((sealed, _),) = _run(instances["decode-sealed"], [sealed_prompt], [params], 8)
    assert sealed.token_ids == want[1].token_ids and sealed.finish_reason == "length"
    assert _stats(instances["decode-sealed"])["handoffs_refused"] == before + 1
    log = (instances["logs"] / "decode-sealed.log").read_text(errors="replace")
    assert "do not verify by their seals" in log
