"""The README's wheel route works: a wheel built from this checkout, offline, installs
with ``--no-deps`` into a throw-away venv, and the copy imported there is the installed
one, package data (``py.typed``) and vLLM plugin entry point included.

The sources are copied out first, so the build writes nothing into the checkout (other
runs may be reading it)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import sortedcontainers

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "kvguard")
BUILD_OUTPUTS = shutil.ignore_patterns("__pycache__", "*.so", "*.pyd", "*.egg-info")

# Run in the throw-away venv, from outside any checkout: prints what that Python imports.
PROBE = """
import json, sys
from importlib import metadata
from importlib.resources import files
import kvguard
dist = metadata.distribution("kvguard")
print(json.dumps({
    "file": kvguard.__file__,
    "py_typed": files("kvguard").joinpath("py.typed").is_file(),
    "plugins": [ep.value for ep in dist.entry_points if ep.group == "vllm.general_plugins"],
    "torch_imported": "torch" in sys.modules,
}))
"""


def _run(command: list[str | Path], cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run a command in a session of its own, killed with whatever it started (pip's
    build backend) if it fails to finish."""
    process = subprocess.Popen(
        [str(part) for part in command],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 0, f"{command} failed:\n{out}\n{err}"
    return out


def test_the_wheel_installs_and_imports_outside_the_checkout(tmp_path: Path) -> None:
    pytest.importorskip("setuptools", minversion="77")  # pyproject's build requirement
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=BUILD_OUTPUTS)
        else:
            shutil.copy2(ROOT / name, source / name)

    dist = tmp_path / "dist"
    offline = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip: list[str | Path] = [sys.executable, "-m", "pip"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", dist, "."], source, offline)
    (wheel,) = dist.glob("kvguard-*.whl")

    # A venv on the base interpreter; kvguard's one dependency (sortedcontainers) is
    # lent from this environment by a .pth line, so nothing is downloaded.
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(_run([python, "-c", purelib], tmp_path).strip())
    (site / "lent.pth").write_text(str(Path(sortedcontainers.__file__).parents[1]) + "\n")
    _run([*pip, "--python", python, "install", "--no-deps", wheel], tmp_path, offline)

    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    found = json.loads(_run([python, "-c", PROBE], tmp_path, clean))
    assert Path(found["file"]).is_relative_to(site), found  # the installed copy, not ROOT's
    assert found["py_typed"], found
    assert found["plugins"] == ["kvguard.adapters.vllm.plugin:register"], found
    assert not found["torch_imported"], found
