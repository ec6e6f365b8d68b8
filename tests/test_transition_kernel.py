"""The transition kernel is the only writer of block records.

Every assignment to a field of a block record (its state, references, hash,
generation) anywhere in the package must be in ``kvguard/transition_kernel.py``; so
must every change of the kernel's side tables (block-level writers, deferred
publications, retention classes) and of the free queue and the zero queue. This test
reads the source: a new writer elsewhere fails it by name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvguard
from kvguard.block import Block

PACKAGE = Path(kvguard.__file__).parent
KERNEL = PACKAGE / "transition_kernel.py"
# Modules that are themselves the structures the kernel owns, or build block records.
OWN_STRUCTURES = {PACKAGE / "free_queue.py", PACKAGE / "zeroing.py", PACKAGE / "block.py"}
RECORD_FIELDS = frozenset(Block.__slots__)
SIDE_TABLES = frozenset({"writers", "deferred", "retention"})
DICT_MUTATORS = frozenset({"pop", "update", "setdefault", "clear", "popitem", "__setitem__"})
QUEUE_MUTATORS = frozenset(
    {
        "push",
        "push_all_empty",
        "push_empty",
        "push_evictable",
        "push_evictable_ids",
        "take",
        "take_empty",
        "remove_evictable",
        "clear_evictable",
        "add_block",
        "add_slots",
    }
)


def _writers(path: Path) -> list[str]:
    """``file:line what`` for every assignment to a block record's field, and every
    call of a free/zero queue mutator, in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[str] = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        if isinstance(node, ast.Delete):
            targets = node.targets
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and sub.attr in RECORD_FIELDS:
                    if isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        continue  # an object's own field (a result, an error), not a block's
                    found.append(f"{path.name}:{sub.lineno} .{sub.attr} =")
                if (
                    isinstance(sub, ast.Subscript)
                    and isinstance(sub.value, ast.Attribute)
                    and sub.value.attr in SIDE_TABLES
                ):
                    found.append(f"{path.name}:{sub.lineno} .{sub.value.attr}[...] =")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            owner = func.value
            if (
                func.attr in QUEUE_MUTATORS
                and isinstance(owner, ast.Attribute)
                and owner.attr in ("free", "zero", "_free", "_zero")
            ):
                found.append(f"{path.name}:{node.lineno} {owner.attr}.{func.attr}()")
            if (
                func.attr in DICT_MUTATORS
                and isinstance(owner, ast.Attribute)
                and owner.attr in SIDE_TABLES
            ):
                found.append(f"{path.name}:{node.lineno} .{owner.attr}.{func.attr}()")
    return found


def test_the_fields_checked_are_the_block_records() -> None:
    assert {"state", "ref_cnt", "block_hash", "external_refs", "generation"} <= RECORD_FIELDS


def test_only_the_transition_kernel_writes_block_records() -> None:
    assert _writers(KERNEL), "the scan finds nothing even in the kernel: it is broken"
    elsewhere = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != KERNEL and path not in OWN_STRUCTURES
        for hit in _writers(path)
    ]
    assert elsewhere == [], "block records written outside transition_kernel.py"


def test_the_scan_finds_a_writer(tmp_path: Path) -> None:
    """The scan is not blind: a façade that assigns a state is found."""
    rogue = tmp_path / "rogue.py"
    rogue.write_text(
        "def f(pool, b):\n"
        "    pool.blocks[b].state = 1\n"
        "    block = pool.blocks[b]\n"
        "    block.ref_cnt += 1\n"
        "    pool._kernel.free.push(block)\n"
        "    pool._kernel.writers[b] = 2\n"
        "    pool._kernel.deferred.pop(b)\n"
    )
    assert sorted(hit.split(" ", 1)[1] for hit in _writers(rogue)) == sorted(
        [".state =", ".ref_cnt =", "free.push()", ".writers[...] =", ".deferred.pop()"]
    )
