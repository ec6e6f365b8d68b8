"""The guard's side in vLLM's workers, patched into the model runners by the plugin:
per-request NaN counts (:mod:`.nans`), zeroing of quarantined blocks (:mod:`.zeroing`),
slot wipes for ``recover`` (:mod:`.slots`) and the KV audit (:mod:`.audit`)."""
