"""Shared storage with seals: a stored copy that is not the validated KV is refused when
it is loaded, on real engines.

Two storage folders, one per side: a stock prefill instance and a stock decode instance
on one, a guarded prefill and a guarded decode instance with seals on
(``KVGUARD_SEAL=1``) on the other. Each prompt is stored by its side's prefill
instance; then the test alters the stored copy on disk -- the way storage rots or a
tier mixes copies up -- and the side's decode instance is asked for the prompt:

* overwritten values, flipped sign bits, a flipped exponent bit, NaN words, the copy
  of another prompt filed under this one's name: each still a loadable safetensors
  file. Stock loads it and answers wrongly, as a normal completion. Guarded, the
  worker seals what it loaded, the seals differ (or the folder is another prompt's),
  the load fails and vLLM's ``kv_load_failure_policy`` (recompute) computes the
  prompt afresh: the fault-free output; the folder is deleted, counted
  (``storage_loads_refused``) and logged;
* a truncated file: stock's engine dies on it (``EngineDeadError``: every request in
  flight lost); guarded, that request's load fails and the engine serves on;
* a copy another model wrote (a decode instance of another model on the same storage,
  as after a restart with another model): stock loads it and answers wrongly; its seals
  were taken under the other model's salt, so the guarded one refuses it.

Engines run in processes of their own (vLLM keeps a process's connector global).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import HAVE_ENGINE, SKIP_REASON

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not HAVE_ENGINE, reason=SKIP_REASON)]

if HAVE_ENGINE:
    import torch
    from safetensors.torch import load_file, save_file  # type: ignore[import-not-found]

    from .conftest import in_process, shutdown
    from .engine import (
        BLOCK,
        ENGINE_KWARGS,
        Result,
        build_model,
        connector_engine,
        generate,
        set_faults,
        tokens,
    )

PROMPT = 100
"""Prompt length: its first 96 tokens (three blocks) are what the connector stores."""


def _engine(model_dir: str, guard: bool, role: str, storage: Path, log: Path) -> Any:
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role=role,
        kv_connector_extra_config={"shared_storage_path": str(storage)},
        kv_load_failure_policy="recompute",
    )
    env = {"KVGUARD_SEAL": "1"} if guard else {}
    return connector_engine(model_dir, guard, config, log, env=env)


@pytest.fixture(scope="module")
def sides(
    model_dir: str, reference: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    logs = tmp_path_factory.mktemp("sealed-storage-logs")
    built: dict[str, Any] = {"logs": logs}
    try:
        for side, guard in (("stock", False), ("sealed", True)):
            storage = tmp_path_factory.mktemp(f"storage-{side}")
            built[f"{side}-storage"] = storage
            for role, name in (("kv_producer", "prefill"), ("kv_consumer", "decode")):
                built[f"{side}-{name}"] = _engine(
                    model_dir, guard, role, storage, logs / f"{side}-{name}.log"
                )
            set_faults(built[f"{side}-decode"], False)
        yield built
    finally:
        for name, llm in built.items():
            if not name.endswith(("storage", "logs")):
                shutdown(llm)


def _store(sides: dict[str, Any], side: str, prompt: list[int]) -> Path:
    """Store ``prompt`` through the side's prefill instance: its new folder."""
    storage: Path = sides[f"{side}-storage"]
    before = set(os.listdir(storage))
    generate(sides[f"{side}-prefill"], [prompt], max_tokens=1)
    (folder,) = set(os.listdir(storage)) - before
    return storage / folder


def _layer_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _rewrite(path: Path, change: Callable[[torch.Tensor], object]) -> None:
    """Load one layer file, change its KV in place, save it back (still loadable)."""
    tensors = load_file(str(path))
    change(tensors["kv_cache"])
    save_file(tensors, str(path))


def _bits(kv: torch.Tensor) -> torch.Tensor:
    return kv.view(torch.int32).view(-1)  # (float32 test model)


def overwrite_values(folder: Path, other: Path) -> None:
    _rewrite(_layer_files(folder)[0], lambda kv: kv.view(-1)[5:40].mul_(1.5))


def flip_sign_bits(folder: Path, other: Path) -> None:
    """The sign of every value of the first stored block, in the first layer."""
    _rewrite(
        _layer_files(folder)[0],
        lambda kv: _bits(kv)[: kv.numel() // 3].bitwise_xor_(-(2**31)),
    )


def flip_an_exponent_bit(folder: Path, other: Path) -> None:
    _rewrite(_layer_files(folder)[0], lambda kv: _bits(kv)[3].bitwise_xor_(1 << 27))


def write_nan_words(folder: Path, other: Path) -> None:
    _rewrite(_layer_files(folder)[1], lambda kv: kv.view(-1)[10:14].fill_(float("nan")))


def file_another_prompts_copy(folder: Path, other: Path) -> None:
    """Every file of ``other`` (seals included, if any) moved in under ``folder``."""
    for theirs in other.iterdir():
        os.replace(theirs, folder / theirs.name)


CORRUPTIONS: dict[str, Callable[[Path, Path], None]] = {
    "overwritten values": overwrite_values,
    "sign bits": flip_sign_bits,
    "exponent bit": flip_an_exponent_bit,
    "NaN words": write_nan_words,
    "another prompt's copy": file_another_prompts_copy,
}
"""Each alters the copy of one prompt (``folder``); ``other``: another prompt's folder."""


def _refused(sides: dict[str, Any]) -> int:
    core = sides["sealed-decode"].llm_engine.engine_core
    return int(core.call_utility("kvguard_stats")["storage_loads_refused"])


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_a_corrupted_copy_is_served_by_stock_and_refused_by_its_seals(
    kind: str, sides: dict[str, Any], reference: Any
) -> None:
    seed = 700 + 10 * sorted(CORRUPTIONS).index(kind)
    prompt, other = tokens(seed, PROMPT), tokens(seed + 1, PROMPT)
    (want,) = generate(reference, [prompt], max_tokens=8)
    stored = (PROMPT - 1) // BLOCK * BLOCK
    for side in ("stock", "sealed"):
        folder, theirs = _store(sides, side, prompt), _store(sides, side, other)
        CORRUPTIONS[kind](folder, theirs)
        refused = _refused(sides) if side == "sealed" else 0
        (out,) = generate(sides[f"{side}-decode"], [prompt], max_tokens=8)
        if side == "stock":
            # Loaded as a prefix hit, and answered from it as a normal completion.
            assert out.num_cached_tokens == stored and out.finish_reason == "length", kind
            assert out.token_ids != want.token_ids, kind
            continue
        # Recomputed (vLLM still counts the tokens it meant to load as cached).
        assert (out.token_ids, out.finish_reason) == (want.token_ids, "length"), kind
        assert not folder.exists(), kind  # deleted: the next reader misses
        assert _refused(sides) == refused + 1, kind
    log = (sides["logs"] / "sealed-decode.log").read_text(errors="replace")
    assert "the load fails and the folder is deleted" in log
    assert "was refused (the worker's log says why)" in log


def test_an_intact_sealed_copy_is_loaded(sides: dict[str, Any], reference: Any) -> None:
    """The control: an unaltered sealed folder verifies and is loaded, not recomputed."""
    prompt = tokens(690, PROMPT)
    (want,) = generate(reference, [prompt], max_tokens=8)
    folder = _store(sides, "sealed", prompt)
    assert (folder / "kvguard-seals.json").exists()
    refused = _refused(sides)
    (out,) = generate(sides["sealed-decode"], [prompt], max_tokens=8)
    assert out == Result(want.token_ids, "length", (PROMPT - 1) // BLOCK * BLOCK)
    assert _refused(sides) == refused


def test_a_copy_another_model_wrote_is_refused_by_its_seals(
    sides: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Decode instances of another model (other weights, same shape) on each side's
    storage, as after a restart with another model: each finds the first model's copy
    of the prompt under the prompt's name."""
    from vllm import LLM

    other_model = build_model(str(tmp_path_factory.mktemp("other-llama")), seed=1)
    with in_process():
        other_reference = LLM(model=other_model, **ENGINE_KWARGS)
    set_faults(other_reference, False)
    logs: Path = sides["logs"]
    readers: dict[str, Any] = {}
    try:
        prompt = tokens(670, PROMPT)
        (want,) = generate(other_reference, [prompt], max_tokens=8)
        for side, guard in (("stock", False), ("sealed", True)):
            folder = _store(sides, side, prompt)
            readers[side] = _engine(
                other_model,
                guard,
                "kv_consumer",
                sides[f"{side}-storage"],
                logs / f"{side}-other.log",
            )
            set_faults(readers[side], False)
            (out,) = generate(readers[side], [prompt], max_tokens=8)
            if side == "stock":
                assert out.num_cached_tokens == (PROMPT - 1) // BLOCK * BLOCK
                assert out.token_ids != want.token_ids  # computed on the other model's KV
                continue
            assert (out.token_ids, out.finish_reason) == (want.token_ids, "length")
            assert not folder.exists()
        assert "does not verify" in (logs / "sealed-other.log").read_text(errors="replace")
    finally:
        for llm in (*readers.values(), other_reference):
            shutdown(llm)


def test_a_truncated_copy_kills_stock_and_fails_one_load_under_the_guard(
    sides: dict[str, Any], reference: Any
) -> None:
    """Last: stock's decode instance dies on it."""
    prompt = tokens(680, PROMPT)
    (want,) = generate(reference, [prompt], max_tokens=8)
    for side in ("sealed", "stock"):
        folder = _store(sides, side, prompt)
        first = _layer_files(folder)[0]
        first.write_bytes(first.read_bytes()[: first.stat().st_size // 2])
        if side == "sealed":
            (out,) = generate(sides["sealed-decode"], [prompt], max_tokens=8)
            assert (out.token_ids, out.finish_reason) == (want.token_ids, "length")
            assert not folder.exists()
            # The engine serves on.
            (again,) = generate(sides["sealed-decode"], [prompt], max_tokens=8)
            assert again.token_ids == want.token_ids
            continue
        with pytest.raises(Exception) as dead:
            generate(sides["stock-decode"], [prompt], max_tokens=8)
        assert "EngineDead" in type(dead.value).__name__ or "EngineDead" in repr(dead.value)
