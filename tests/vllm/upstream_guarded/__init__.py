"""vLLM 0.34's own scheduler tests, run again under kvguard's guard (see conftest.py)."""
