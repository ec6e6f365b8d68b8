"""No connector reads a block record itself: every exit asks the exit gate.

The rule "a block may leave only when VALIDATED or later under the request's key" lives
in the core (``kvguard.tier_gate.storable_as``) and is asked by one adapter module,
``kvguard/adapters/vllm/exits/gate.py``. Any other module under ``exits/`` that reads a
block's ``.state``, ``.block_hash`` or ``.generation``, or imports the state table's
names, is writing the rule (or a part of it) again: this scan fails, naming the line.
(A static scan, no vLLM needed; a ticket's ``block_hash`` counts too -- the gate settles
tickets.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

EXITS = Path(__file__).parent.parent / "kvguard" / "adapters" / "vllm" / "exits"
GATE = "gate.py"
READS = frozenset({"state", "block_hash", "generation"})
STATE_NAMES = frozenset({"BlockState", "STORABLE_STATES", "MATCHABLE_STATES"})


def block_reads(source: str, filename: str) -> list[str]:
    """``file:line: what`` for each read of a block record's state, hash or generation,
    and each import of the state table's names, in ``source``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and node.attr in READS:
            found.append(f"{filename}:{node.lineno}: reads .{node.attr}")
        elif isinstance(node, ast.ImportFrom):
            names = {alias.name for alias in node.names}
            if node.module == "kvguard.states" or names & STATE_NAMES:
                found.append(f"{filename}:{node.lineno}: imports {sorted(names)}")
        elif isinstance(node, ast.Import) and any(
            alias.name == "kvguard.states" for alias in node.names
        ):
            found.append(f"{filename}:{node.lineno}: imports kvguard.states")
    return found


def connector_modules() -> list[Path]:
    return sorted(p for p in EXITS.glob("*.py") if p.name != GATE)


def test_the_scan_sees_the_connector_modules() -> None:
    names = {p.name for p in connector_modules()}
    assert {"offloading.py", "example_connector.py", "coverage.py"} <= names, names
    assert (EXITS / GATE).is_file()


@pytest.mark.parametrize("path", connector_modules(), ids=lambda p: p.name)
def test_no_connector_reads_a_block_record(path: Path) -> None:
    found = block_reads(path.read_text(), path.name)
    assert not found, "ask the exit gate (exits/gate.py) instead: " + "; ".join(found)


@pytest.mark.parametrize(
    "planted",
    [
        "def f(pool, b):\n    return pool.blocks[b].state\n",
        "def f(block, key):\n    return block.block_hash == key\n",
        "def f(records, b, g):\n    return records[b].generation != g\n",
        "from kvguard.states import STORABLE_STATES\n",
        "from kvguard.states import BlockState as S\n",
        "import kvguard.states\n",
    ],
)
def test_the_scan_catches_a_planted_read(planted: str) -> None:
    """The scan can fail: each way of reading a block record is caught."""
    clean = (EXITS / "coverage.py").read_text()
    assert block_reads(clean, "coverage.py") == []
    assert block_reads(clean + "\n" + planted, "planted.py")


def test_the_gate_itself_reads_block_records() -> None:
    """The gate is where the reads are (else the scan above would prove nothing)."""
    assert block_reads((EXITS / GATE).read_text(), GATE)
