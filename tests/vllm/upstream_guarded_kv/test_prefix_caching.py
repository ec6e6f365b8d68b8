"""vLLM 0.34's test_prefix_caching.py (tests/vllm/upstream/v0_34/), collected
again on kvguard's guarded pool; conftest.py here says which of its tests run, and how."""

from .guard import vendored_tests

globals().update(vendored_tests("test_prefix_caching"))
