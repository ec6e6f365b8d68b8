"""vLLM 0.34's test_swa_inflight_window_free.py (tests/vllm/upstream/v0_34/), collected again
under kvguard's guard: see conftest.py here."""

from .guard import vendored_tests

globals().update(vendored_tests("test_swa_inflight_window_free"))
