"""Every way KV leaves a guarded vLLM instance: which connectors are gated and how
(:mod:`.coverage`), the gated connectors (CPU offloading, SimpleCPU offloading, shared
storage), binding them to kvguard's pool, and the purge of tier copies found corrupt."""
