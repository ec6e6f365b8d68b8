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
