"""After the README's editable install (``pip install -e .``), ``mypy --strict`` on a
user's script finds kvguard and its types (``py.typed``).

setuptools' default editable install for a checkout laid out like this one is an import
hook, which mypy cannot follow ("Cannot find implementation or library stub"); the
project's ``package-dir`` makes it a plain path line instead (pyproject.toml). The
sources are copied out first, so the install builds nothing into the checkout (other
runs may be importing its compiled extension).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import venv
from pathlib import Path

import pytest

mypy = pytest.importorskip("mypy")

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "kvguard")
BUILD_OUTPUTS = shutil.ignore_patterns("__pycache__", "*.so", "*.pyd", "*.egg-info")

USER_SCRIPT = """\
from kvguard import BlockPool, StepResult


def first_step(pool: BlockPool, prompt: list[int]) -> StepResult:
    pool.add_request("r", prompt)
    pool.allocate("r", len(prompt))
    pool.write("r", len(prompt))
    return pool.validate_step("r")


count: int = first_step(BlockPool(16, 4), [1, 2, 3]).num_validated_tokens
"""


def _run(command: list[str | Path], cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """Run a command in a session of its own, killed with whatever it started (pip's
    build backend) if it fails to finish; its exit status and output."""
    process = subprocess.Popen(
        [str(part) for part in command],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    return process.returncode, out


def test_mypy_strict_finds_kvguard_after_an_editable_install(tmp_path: Path) -> None:
    pytest.importorskip("setuptools", minversion="77")  # pyproject's build requirement
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=BUILD_OUTPUTS)
        else:
            shutil.copy2(ROOT / name, source / name)

    # A venv on the base interpreter; the build backend (setuptools) and mypy are lent
    # from this environment by a .pth line (a plain path: this environment's own
    # editable kvguard stays out), so nothing is downloaded.
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env |= {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "MYPYPATH": ""}
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    rc, site = _run([python, "-c", purelib], tmp_path, env)
    assert rc == 0, site
    lent = Path(mypy.__file__).parents[1]
    (Path(site.strip()) / "lent.pth").write_text(f"{lent}\n")
    pip: list[str | Path] = [sys.executable, "-m", "pip", "--python", python]
    rc, out = _run(
        [*pip, "install", "--no-deps", "--no-build-isolation", "-e", source], tmp_path, env
    )
    assert rc == 0, out

    user = tmp_path / "user"  # outside any checkout: no mypy config, no kvguard beside it
    user.mkdir()
    (user / "app.py").write_text(USER_SCRIPT)
    rc, out = _run([python, "-m", "mypy", "--strict", "--no-incremental", "app.py"], user, env)
    assert rc == 0 and "Success: no issues found" in out, out
