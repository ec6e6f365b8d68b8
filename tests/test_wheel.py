"""The README's wheel route works: a wheel built from this checkout, offline, installs
with ``--no-deps`` into a throw-away venv, and the copy imported there is the installed
one, package data (``py.typed``) and vLLM plugin entry point included."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import sortedcontainers

from tests.install_sandbox import OFFLINE_ENV, checked, copy_sources, throwaway_venv

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


def test_the_wheel_installs_and_imports_outside_the_checkout(tmp_path: Path) -> None:
    pytest.importorskip("setuptools", minversion="77")  # pyproject's build requirement
    source = copy_sources(tmp_path / "source")
    dist = tmp_path / "dist"
    pip: list[str | Path] = [sys.executable, "-m", "pip"]
    checked(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", dist, "."], source, OFFLINE_ENV
    )
    (wheel,) = dist.glob("kvguard-*.whl")

    # kvguard's one dependency (sortedcontainers) is lent from this environment.
    python, site = throwaway_venv(tmp_path / "venv", Path(sortedcontainers.__file__).parents[1])
    checked([*pip, "--python", python, "install", "--no-deps", wheel], tmp_path, OFFLINE_ENV)

    found = json.loads(checked([python, "-c", PROBE], tmp_path, OFFLINE_ENV))
    assert Path(found["file"]).is_relative_to(site), found  # the installed copy, not ROOT's
    assert found["py_typed"], found
    assert found["plugins"] == ["kvguard.adapters.vllm.plugin:register"], found
    assert not found["torch_imported"], found
