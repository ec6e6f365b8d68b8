"""A throw-away install of this checkout, for the tests of the README's install routes
(test_wheel.py, test_editable_typing.py).

The sources are copied out first, so a build writes nothing into the checkout (other
runs may be importing its compiled extension); the venv is on the base interpreter, and
what it needs from this environment is lent by a ``.pth`` line (a plain path), so
nothing is downloaded."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "kvguard")
BUILD_OUTPUTS = shutil.ignore_patterns("__pycache__", "*.so", "*.pyd", "*.egg-info")

OFFLINE_ENV = {
    **{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")},
    "PIP_NO_INDEX": "1",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
}
"""This environment without a path that would leak this checkout in, pip offline."""


def run(command: list[str | Path], cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """Run a command in a session of its own, killed with whatever it started (pip's
    build backend) if it fails to finish; its exit status and output (stderr
    included)."""
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


def checked(command: list[str | Path], cwd: Path, env: dict[str, str]) -> str:
    """:func:`run`, failing the test (with the output) unless the command succeeds."""
    rc, out = run(command, cwd, env)
    assert rc == 0, f"{command} failed:\n{out}"
    return out


def copy_sources(dest: Path) -> Path:
    """What a build of the checkout reads, copied to ``dest`` (created)."""
    dest.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, dest / name, ignore=BUILD_OUTPUTS)
        else:
            shutil.copy2(ROOT / name, dest / name)
    return dest


def throwaway_venv(env_dir: Path, lend: Path) -> tuple[Path, Path]:
    """A venv without pip at ``env_dir`` with ``lend`` (a site-packages folder of this
    environment) on its path: its python and its own site-packages."""
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(checked([python, "-c", purelib], env_dir, OFFLINE_ENV).strip())
    (site / "lent.pth").write_text(f"{lend}\n")
    return python, site
