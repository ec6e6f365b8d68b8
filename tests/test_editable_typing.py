"""After the README's editable install (``pip install -e .``), ``mypy --strict`` on a
user's script finds kvguard and its types (``py.typed``).

setuptools' default editable install for a checkout laid out like this one is an import
hook, which mypy cannot follow ("Cannot find implementation or library stub"); the
project's ``package-dir`` makes it a plain path line instead (pyproject.toml).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.install_sandbox import OFFLINE_ENV, checked, copy_sources, run, throwaway_venv

mypy = pytest.importorskip("mypy")

USER_SCRIPT = """\
from kvguard import BlockPool, StepResult


def first_step(pool: BlockPool, prompt: list[int]) -> StepResult:
    pool.add_request("r", prompt)
    pool.allocate("r", len(prompt))
    pool.write("r", len(prompt))
    return pool.validate_step("r")


count: int = first_step(BlockPool(16, 4), [1, 2, 3]).num_validated_tokens
"""


def test_mypy_strict_finds_kvguard_after_an_editable_install(tmp_path: Path) -> None:
    pytest.importorskip("setuptools", minversion="77")  # pyproject's build requirement
    source = copy_sources(tmp_path / "source")
    # The build backend (setuptools) and mypy are lent from this environment (a plain
    # path: this environment's own editable kvguard stays out).
    python, _ = throwaway_venv(tmp_path / "venv", Path(mypy.__file__).parents[1])
    env = OFFLINE_ENV | {"MYPYPATH": ""}
    pip: list[str | Path] = [sys.executable, "-m", "pip", "--python", python]
    checked([*pip, "install", "--no-deps", "--no-build-isolation", "-e", source], tmp_path, env)

    user = tmp_path / "user"  # outside any checkout: no mypy config, no kvguard beside it
    user.mkdir()
    (user / "app.py").write_text(USER_SCRIPT)
    rc, out = run([python, "-m", "mypy", "--strict", "--no-incremental", "app.py"], user, env)
    assert rc == 0 and "Success: no issues found" in out, out
