"""The public face: import isolation, ``__all__`` against the docs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import kvguard

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
        "block_state": (held,),
        "block_table": ("r",),
        "cached_block_id": (block_hash,),
        "can_allocate": ("r", 12),
        "progress": ("r",),
        "storable_blocks": ("r",),
        "tier_copies": (block_hash,),
    }
    for name in _READERS:
        before = pool.snapshot()
        getattr(pool, name)(*arguments.get(name, ()))
        assert pool.snapshot() == before, name
