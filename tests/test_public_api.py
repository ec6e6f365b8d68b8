"""The public face: import isolation, ``__all__`` against the docs."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import kvguard
from kvguard.block_steps import BlockSteps
from kvguard.hashing import BlockHash
from kvguard.pool import _MUTATORS, _READERS
from kvguard.recovery import Recovery
from kvguard.request_steps import RequestSteps
from kvguard.tier_gate import TierGate

ROOT = Path(__file__).parent.parent


def test_import_kvguard_leaves_heavy_packages_out() -> None:
    code = (
        "import sys, kvguard, kvguard.pool, kvguard.statedoc; "
        "heavy = [m for m in ('torch', 'triton', 'vllm', 'numpy') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "", f"import kvguard pulled in: {out}"


def test_all_matches_docs() -> None:
    doc = (ROOT / "docs" / "api.md").read_text()
    section = doc.split("## Public names", 1)[1]
    first_cells = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    documented = {n for cell in first_cells for n in re.findall(r"`(\w+)`", cell)}
    assert documented == set(kvguard.__all__)


def test_all_names_exist() -> None:
    for name in kvguard.__all__:
        assert hasattr(kvguard, name), name


def test_docs_example_runs() -> None:
    doc = (ROOT / "docs" / "api.md").read_text()
    example = re.search(r"```python\n(.*?)```", doc, re.S)
    assert example is not None
    exec(compile(example.group(1), "docs/api.md", "exec"), {})


def test_every_public_pool_method_is_a_mutator_or_a_reader() -> None:
    """``KVGUARD_CHECK_INVARIANTS`` wraps the mutators: a new public method must be
    classified, or it would escape the check."""
    import inspect

    from kvguard.pool import _MUTATORS, _READERS

    public = {
        name
        for name, value in inspect.getmembers(kvguard.BlockPool)
        if not name.startswith("_") and callable(value)
    }
    assert not set(_MUTATORS) & set(_READERS)
    assert public == set(_MUTATORS) | set(_READERS)


def test_readers_change_nothing() -> None:
    """Each reader, called on a pool in use, leaves its snapshot as it was."""
    from kvguard.pool import _READERS

    pool = kvguard.BlockPool(16, 4)
    pool.add_request("r", list(range(10)))
    pool.allocate("r", 10, hit=pool.lookup("r"))
    pool.write("r", 10)
    pool.validate_step("r")
    (held,) = pool.allocate_blocks(1, write=True)
    block_hash = pool.block_hash(pool.block_table("r")[0])
    assert block_hash is not None
    arguments = {
        "block_hash": (held,),
        "block_info": (held,),
        "block_seal": (held,),
        "block_state": (held,),
        "block_table": ("r",),
        "cached_block_id": (block_hash,),
        "can_allocate": ("r", 12),
        "progress": ("r",),
        "storable_blocks": ("r",),
        "tier_copies": (block_hash,),
        "tier_seal": (block_hash, "default"),
    }
    for name in _READERS:
        before = pool.snapshot()
        result = getattr(pool, name)(*arguments.get(name, ()))
        if isinstance(result, Iterator):  # (free_block_ids: read as it is walked)
            list(result)
        assert pool.snapshot() == before, name


FACADES = {
    "request_steps": RequestSteps,
    "block_steps": BlockSteps,
    "tier_gate": TierGate,
    "recovery": Recovery,
}


def test_the_pool_is_composed_of_facades_that_reach_no_other() -> None:
    """Each façade is an object of its own class over the shared core, a read-only
    attribute of the pool; no façade module imports another or the pool."""
    import ast

    import pytest

    pool = kvguard.BlockPool(8, 4)
    for name, cls in FACADES.items():
        facade = getattr(pool, name)
        assert type(facade) is cls, name
        assert facade._core is pool._core, name  # type: ignore[attr-defined]
        with pytest.raises(AttributeError):
            setattr(pool, name, facade)

    modules = ["request_steps", "block_steps", "tier_gate", "recovery"]
    root = Path(kvguard.__file__).parent
    for module in modules:
        tree = ast.parse((root / f"{module}.py").read_text())
        imported = {
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module is not None
        }
        reached = imported & {f"kvguard.{m}" for m in [*modules, "pool"]}
        assert not reached, f"{module} imports {reached}"


def test_a_facade_method_of_the_pool_is_its_facades_by_signature_and_contract() -> None:
    """The pool's method of a façade method's name is a real method of the class (no
    instance binding hides it from readers and type checkers) with the façade
    method's signature and docstring, and calling it calls the façade."""
    import inspect

    delegated = set()
    for name, member in vars(kvguard.BlockPool).items():
        owners = [cls for cls in FACADES.values() if name in vars(cls)]
        if name.startswith("_") or not owners:
            continue
        (owner,) = owners
        facade_method = getattr(owner, name)
        assert inspect.isfunction(member), name
        assert inspect.signature(member) == inspect.signature(facade_method), name
        assert member.__doc__, name
        assert member.__doc__ == facade_method.__doc__, name
        delegated.add(name)
    public = {*_MUTATORS, *_READERS}
    assert delegated == {n for n in public if any(n in vars(c) for c in FACADES.values())}
    pool = kvguard.BlockPool(8, 4)
    assert "allocate_blocks" not in vars(pool)  # (nothing bound on the instance)
    (a, b) = kvguard.BlockPool.allocate_blocks(pool, 2)
    assert pool.block_steps.cached_block_id(BlockHash(b"x")) is None
    assert pool.block_info(a).ref_cnt == pool.block_info(b).ref_cnt == 1


def _call_every_mutator(
    pool: kvguard.BlockPool, via_facades: bool, after: Callable[[str], None]
) -> None:
    """Call each mutator on a pool in use, in an order in which each call is legal,
    and ``after(name)`` once each call returned; with ``via_facades``, a façade's
    mutator is called on the façade object, not through the pool."""

    def call(name: str, *args: object, **kwargs: object) -> Any:
        owner: object = pool
        if via_facades:
            owner = next(
                (getattr(pool, a) for a, cls in FACADES.items() if name in vars(cls)), pool
            )
        result = getattr(owner, name)(*args, **kwargs)
        after(name)
        return result

    h1, h2 = BlockHash(bytes(16)), BlockHash(bytes(15) + b"\x01")
    call("add_request", "r", list(range(10)))
    hit = call("lookup", "r")
    call("allocate", "r", 10, hit=hit)
    call("write", "r", 10)
    call("fail_step", "r")
    call("zero_request_tail", "r")
    call("write", "r", 10)
    call("validate_step", "r")
    call("append_tokens", "r", [10, 11])
    call("free", "r")
    call("add_request", "h", block_hashes=[h1])
    call("append_block_hashes", "h", [h2])
    call("free", "h")
    (a, b, c) = call("allocate_blocks", 3, write=True)
    (d,) = call("allocate_blocks", 1)
    call("write_blocks", [d])
    call("fail_blocks", [d])
    call("roll_back_blocks", {c: 1})
    call("publish_block", a, h1)
    call("validate_blocks", [a, b])
    call("acquire_blocks", [a])
    call("release_blocks", [a])
    pool.block_records[b].ref_cnt += 1  # as an engine's copy-on-write counts one
    call("disown_reference", b)
    ticket = call("begin_store", a)
    call("ack_store", ticket)
    call("fail_store", call("begin_store", a, "other"))
    call("forget_tier_copy", "default", h1)
    call("invalidate", [h1])
    call("release_blocks", [a, b, c, d])
    for name in ("take_blocks_to_zero", "take_slots_to_zero", "take_events"):
        call(name)
    assert call("reset_prefix_cache")


@pytest.mark.parametrize("via_facades", [False, True], ids=["pool", "facades"])
def test_the_invariant_check_follows_every_mutator(
    monkeypatch: pytest.MonkeyPatch, via_facades: bool
) -> None:
    """With ``check_invariants=True`` each mutating call checks the pool once, made on
    the pool or on its façade (the hot callers' way); without it, none does."""
    import kvguard.invariants
    import kvguard.pool

    checks: list[object] = []
    real_check = kvguard.invariants.check_pool

    def counting_check(pool: kvguard.BlockPool) -> None:
        checks.append(pool)
        real_check(pool)

    monkeypatch.setattr(kvguard.pool, "check_pool", counting_check)
    pool = kvguard.BlockPool(8, 4, check_invariants=True)
    called: list[str] = []

    def checked_once(name: str) -> None:
        called.append(name)
        assert len(checks) == len(called), f"{name} was not checked"

    _call_every_mutator(pool, via_facades, checked_once)
    assert set(called) == set(_MUTATORS)
    assert set(checks) == {pool}

    checks.clear()
    quiet = kvguard.BlockPool(8, 4, check_invariants=False)
    _call_every_mutator(quiet, via_facades, lambda name: None)
    assert checks == []


def test_a_subclass_override_is_not_shadowed_by_the_facade_binding() -> None:
    calls: list[int] = []

    class Counting(kvguard.BlockPool):
        def allocate_blocks(self, num_blocks: int, *, write: bool = False) -> list[int]:
            calls.append(num_blocks)
            return super().allocate_blocks(num_blocks, write=write)

    pool = Counting(8, 4)
    assert len(pool.allocate_blocks(3)) == 3
    assert calls == [3]


def test_the_settings_are_read_only() -> None:
    """Fixed at construction: the kernel applies them, so the pool cannot change them."""
    import pytest

    pool = kvguard.BlockPool(8, 4, enable_caching=False, record_events=False)
    assert (pool.num_blocks, pool.block_size) == (8, 4)
    assert (pool.enable_caching, pool.record_events) == (False, False)
    assert pool.zero_policy is kvguard.ZeroPolicy.SUSPECT
    for name in ("num_blocks", "block_size", "enable_caching", "zero_policy", "record_events"):
        with pytest.raises(AttributeError):
            setattr(pool, name, getattr(pool, name))


def _table_names(doc: str, header: str) -> set[str]:
    """The backquoted names in the first column of the table headed ``| <header> |``."""
    table = doc.split(f"| {header} |", 1)[1].split("\n\n", 1)[0]
    cells = [line.split("|")[1] for line in table.splitlines()[2:] if line.startswith("|")]
    return {n for cell in cells for n in re.findall(r"`(\w+)`", cell)}


def _attribute_docstrings(cls: type) -> set[str]:
    """The fields of ``cls`` (in its module's source) followed by a docstring."""
    import ast
    import inspect
    import itertools

    node = ast.parse(inspect.getsource(cls)).body[0]
    assert isinstance(node, ast.ClassDef)
    body = node.body
    return {
        stmt.target.id
        for stmt, after in itertools.pairwise(body)
        if isinstance(stmt, ast.AnnAssign)
        and isinstance(stmt.target, ast.Name)
        and isinstance(after, ast.Expr)
        and isinstance(after.value, ast.Constant)
    }


def test_every_counter_and_stats_field_is_documented() -> None:
    import dataclasses

    doc = (ROOT / "docs" / "api.md").read_text()
    counters = {f.name for f in dataclasses.fields(kvguard.Counters)}
    assert _table_names(doc, "`Counters` field") == counters
    assert _attribute_docstrings(kvguard.Counters) == counters
    stats = {f.name for f in dataclasses.fields(kvguard.PoolStats)}
    properties = {"usage", "prefix_hit_rate"}
    assert _table_names(doc, "`PoolStats` field") == stats | properties
    # The settings and the nested counters explain themselves; the counts do not.
    assert _attribute_docstrings(kvguard.PoolStats) == stats - {
        "num_blocks",
        "block_size",
        "counters",
    }
