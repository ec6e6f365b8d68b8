"""Which vLLM releases the adapter supports, checked before any vLLM internal is touched.

The adapter reaches into vLLM internals (``BlockPool``, ``Scheduler.update_from_output``,
``SingleTypeKVCacheManager.req_to_blocks``) that change between minor releases. Adding
the next release: run ``pytest -m vllm tests/vllm`` against it (``.ci/install-vllm``
with the new pin), fix what breaks, then add its ``major.minor`` to ``SUPPORTED``.
"""

from __future__ import annotations

from kvguard.errors import KvGuardError

SUPPORTED: tuple[str, ...] = ("0.33",)
"""``major.minor`` vLLM series the adapter is tested against."""


class UnsupportedVllmError(KvGuardError):
    """The installed vLLM is not a series the adapter was tested against."""


def check_vllm_version(version: str) -> None:
    """Raise :class:`UnsupportedVllmError` unless ``version`` is a supported series."""
    series = ".".join(version.split("+")[0].split(".")[:2])
    if series not in SUPPORTED:
        raise UnsupportedVllmError(
            f"kvguard's vLLM adapter supports vLLM {', '.join(s + '.x' for s in SUPPORTED)}; "
            f"found vllm=={version}. Install a supported vLLM, or port the adapter "
            "(see kvguard/adapters/vllm/_compat.py)."
        )


def require_supported_vllm() -> None:
    import vllm

    check_vllm_version(vllm.__version__)
