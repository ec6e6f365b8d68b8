"""Row (d) of ``benchmarks/pool_ops.py`` measures a sketch of a batch
``validate_steps``: its figures mean something only if the sketch does exactly what the
single ``validate_step`` calls do. Checked here side by side, then the row itself."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import pytest

from kvguard import BlockPool, PoolMisuseError
from kvguard.hashing import hash_block_tokens

from .helpers import BENCHMARKS


def _pool_ops() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pool_ops", BENCHMARKS / "pool_ops.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


pool_ops = _pool_ops()
IDS = ("a", "b", "c", "d")


def _twin_pools() -> tuple[BlockPool, BlockPool]:
    """Two pools driven alike: four requests; b's prompt is a's (its full blocks are
    duplicates of a's once both publish)."""
    pools = (BlockPool(64, 4, check_invariants=True), BlockPool(64, 4, check_invariants=True))
    for pool in pools:
        for rid in IDS:
            tokens = [ord(rid)] * 16 if rid != "b" else [ord("a")] * 16
            # The hashes of the blocks its later steps fill are known up front.
            pool.add_request(rid, tokens[:9], block_hashes=hash_block_tokens(tokens, 4))
    return pools


def _schedule(pool: BlockPool, num_tokens: int) -> None:
    """A step writing every open request up to ``num_tokens`` tokens."""
    for rid in IDS:
        progress = pool.progress(rid)
        if progress.aborted or progress.num_written_tokens >= num_tokens:
            continue
        pool.allocate(rid, num_tokens)
        pool.write(rid, num_tokens - progress.num_written_tokens)


def test_the_sketch_does_what_the_single_calls_do() -> None:
    single, batch = _twin_pools()
    for num_tokens in (9, 10, 11, 12, 13):
        _schedule(single, num_tokens)
        _schedule(batch, num_tokens)
        if num_tokens == 10:  # two steps in flight; c's first fails, its second is
            for pool in (single, batch):  # discarded when its result comes
                _schedule(pool, 11)
                pool.fail_step("c")
        ids = [rid for rid in IDS if single.progress(rid).num_pending_steps]
        expected = [single.validate_step(rid) for rid in ids]
        assert pool_ops.validate_steps_sketch(batch, ids) == expected
        assert batch.take_events() == single.take_events()
        assert batch.snapshot() == single.snapshot()
        assert batch.counters() == single.counters()
    counters = single.counters()
    assert counters.blocks_published and counters.steps_validated and counters.steps_failed


def test_the_sketch_checks_every_id_before_it_changes_anything() -> None:
    pool, _ = _twin_pools()
    _schedule(pool, 9)
    before = pool.snapshot()
    for ids in (["a", "b", "nope"], ["a", "a"], ["a", "b", "c", "d", "a"]):
        with pytest.raises(PoolMisuseError):
            pool_ops.validate_steps_sketch(pool, ids)
        assert pool.snapshot() == before


def test_the_row_times_both_forms_and_states_the_verdict() -> None:
    cfg = pool_ops.Config(batch_requests=(2, 64), batch_steps=4)
    rows = [(n, *pool_ops.batch_validation(cfg, n)) for n in cfg.batch_requests]
    assert all(calls > 0 and one > 0 for _, calls, one in rows)
    lines = pool_ops.batch_report(cfg, rows)
    assert lines[-1].startswith("(d) a batch form pays")
    # The verdict reads the ratios at 64+ requests only, against PAYS_AT_MOST.
    assert pool_ops.batch_report(cfg, [(8, 100.0, 50.0), (64, 100.0, 95.0)])[-1].endswith("no")
    assert pool_ops.batch_report(cfg, [(8, 100.0, 99.0), (64, 100.0, 85.0)])[-1].endswith("yes")
