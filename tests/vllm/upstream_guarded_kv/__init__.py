"""vLLM 0.34's own KV-cache tests for Mamba, hybrid and partial-block groups, run again
on kvguard's guarded pool (see conftest.py)."""
