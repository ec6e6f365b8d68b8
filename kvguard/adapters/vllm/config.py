"""The adapter's settings: what the guard does inside vLLM, read with no code change.

Sources, first match wins: ``VllmConfig.additional_config["kvguard"]`` (a dict, e.g.
``--additional-config '{"kvguard": {"zero_policy": "all"}}'``), then environment
variables ``KVGUARD_GUARD`` (``0`` = pass-through), ``KVGUARD_ZERO_POLICY``
(``suspect``/``all``/``none``), ``KVGUARD_AUDIT`` (``1`` = the KV audit),
``KVGUARD_CHECK_INVARIANTS``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvguard.errors import PoolMisuseError
from kvguard.zeroing import ZeroPolicy

CONFIG_KEY = "kvguard"


class GuardConfigError(PoolMisuseError):
    """The kvguard settings (or the vLLM settings the guard needs) are wrong."""


@dataclass(frozen=True, slots=True)
class GuardConfig:
    enabled: bool = True
    """False: pass-through -- the guarded scheduler classes build vLLM's own scheduler,
    on vLLM's own pool."""
    zero_policy: ZeroPolicy = ZeroPolicy.SUSPECT
    """Which reused blocks the worker zeroes (``new_block_ids_to_zero``)."""
    audit: bool = False
    """The KV audit: workers scan the blocks each step fills for NaN and infinities
    (one launch per step), and a request whose filled blocks hold one fails that step
    as for NaN logits -- finite logits do not prove finite KV."""
    check_invariants: bool = False
    """Walk kvguard's whole pool after every mutation (tests, debugging)."""

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> GuardConfig:
        unknown = set(values) - {"enabled", "zero_policy", "audit", "check_invariants"}
        if unknown:
            raise GuardConfigError(f"unknown kvguard settings: {sorted(unknown)}")
        try:
            policy = ZeroPolicy(values.get("zero_policy", ZeroPolicy.SUSPECT.value))
        except ValueError:
            raise GuardConfigError(
                f"zero_policy must be one of {[p.value for p in ZeroPolicy]}, "
                f"got {values.get('zero_policy')!r}"
            ) from None
        return cls(
            enabled=bool(values.get("enabled", True)),
            zero_policy=policy,
            audit=bool(values.get("audit", False)),
            check_invariants=bool(values.get("check_invariants", False)),
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> GuardConfig:
        return cls.from_mapping(
            {
                "enabled": environ.get("KVGUARD_GUARD", "1") not in ("0", "", "false"),
                "zero_policy": environ.get("KVGUARD_ZERO_POLICY", ZeroPolicy.SUSPECT.value),
                "audit": environ.get("KVGUARD_AUDIT", "0") not in ("0", "", "false"),
                "check_invariants": environ.get("KVGUARD_CHECK_INVARIANTS", "0") not in ("0", ""),
            }
        )

    @classmethod
    def from_vllm(cls, additional_config: object) -> GuardConfig:
        """Settings from ``VllmConfig.additional_config`` when it has a kvguard entry."""
        if isinstance(additional_config, Mapping) and CONFIG_KEY in additional_config:
            values = additional_config[CONFIG_KEY]
            if not isinstance(values, Mapping):
                raise GuardConfigError(f"additional_config[{CONFIG_KEY!r}] must be a dict")
            return cls.from_mapping(values)
        return cls.from_env()
