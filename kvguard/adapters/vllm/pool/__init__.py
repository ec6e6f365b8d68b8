"""kvguard's pool under vLLM's KV cache manager: the block pool vLLM's managers call
(:mod:`.block_pool`), the block records they read (:mod:`.kv_block`), and its
installation in a ``KVCacheManager`` (:mod:`.manager`)."""
