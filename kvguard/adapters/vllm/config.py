"""The adapter's settings: what the guard does inside vLLM, read with no code change.

Sources, first match wins: ``VllmConfig.additional_config["kvguard"]`` (a dict, e.g.
``--additional-config '{"kvguard": {"zero_policy": "all"}}'``), then environment
variables ``KVGUARD_GUARD`` (``0`` = pass-through), ``KVGUARD_ZERO_POLICY``
(``suspect``/``all``/``none``), ``KVGUARD_AUDIT`` (``1`` = the KV audit),
``KVGUARD_SEAL`` (``1`` = seals), ``KVGUARD_CHECK_INVARIANTS``.

Also what start-up in this process found, recorded by the plugin
(:mod:`kvguard.adapters.vllm.plugin`) and read by the guarded scheduler, so that the
scheduler side never imports the plugin: whether an engine's config switched the guard
on here, and what the engine core's check of its workers found.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvguard.adapters.vllm._compat import zeroing_is_a_field
from kvguard.adapters.vllm.workers import nans as worker_nans
from kvguard.errors import PoolMisuseError
from kvguard.zeroing import ZeroPolicy

CONFIG_KEY = "kvguard"
GUARD_ENV = "KVGUARD_GUARD"
NAN_SETTING = "VLLM_COMPUTE_NANS_IN_LOGITS"
SWITCHED_ON = ("1", "true", "yes", "on")
"""How the environment says yes."""
STOCK_ZEROING = "_kvguard_stock_zeroing"
"""The attribute where the plugin keeps vLLM's own ``needs_kv_cache_zeroing`` (vLLM 0.34,
where it is a field) before making it true."""


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
    seal: bool = False
    """Seals: workers fingerprint the blocks each step fills (one launch per step), and
    the pool records each block's seal when the step validates; copies carry it, and a
    load is verified against it (docs/vllm-reference.md, "Seals")."""
    check_invariants: bool = False
    """Walk kvguard's whole pool after every mutation (tests, debugging)."""

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> GuardConfig:
        unknown = set(values) - {"enabled", "zero_policy", "audit", "seal", "check_invariants"}
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
            seal=bool(values.get("seal", False)),
            check_invariants=bool(values.get("check_invariants", False)),
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> GuardConfig:
        return cls.from_mapping(
            {
                "enabled": environ.get("KVGUARD_GUARD", "1") not in ("0", "", "false"),
                "zero_policy": environ.get("KVGUARD_ZERO_POLICY", ZeroPolicy.SUSPECT.value),
                "audit": environ.get("KVGUARD_AUDIT", "0") not in ("0", "", "false"),
                "seal": environ.get("KVGUARD_SEAL", "0") not in ("0", "", "false"),
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


def requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for the guard (explicit ``KVGUARD_GUARD=1``)."""
    return str(environ.get(GUARD_ENV, "")).strip().lower() in SWITCHED_ON


def requested_by(vllm_config: Any, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the guard is asked for in a process given ``vllm_config``: its
    ``additional_config["kvguard"]`` when there is one (enabled unless it says
    ``"enabled": false``), else the environment (:func:`requested`)."""
    additional = getattr(vllm_config, "additional_config", None)
    if isinstance(additional, Mapping) and CONFIG_KEY in additional:
        return GuardConfig.from_vllm(additional).enabled
    return requested(environ)


def guard_config(vllm_config: Any) -> GuardConfig:
    """The guard's settings for the engine of ``vllm_config``: its
    ``additional_config["kvguard"]``, else the environment."""
    return GuardConfig.from_vllm(getattr(vllm_config, "additional_config", None))


def is_pooling_model(vllm_config: Any) -> bool:
    """Whether the engine runs a pooling model (embedding, reranking, ...): its steps
    sample nothing and vLLM reports no NaN counts for them."""
    return bool(vllm_config.model_config.runner_type == "pooling")


def stock_needs_zeroing(kv_cache_config: Any) -> bool:
    """What vLLM itself decides for ``kv_cache_config`` (the plugin's patch undone)."""
    if zeroing_is_a_field():
        return bool(getattr(kv_cache_config, STOCK_ZEROING, kv_cache_config.needs_kv_cache_zeroing))
    prop = type(kv_cache_config).__dict__.get("needs_kv_cache_zeroing")
    fget = getattr(prop, "fget", None)
    if fget is None:
        return bool(kv_cache_config.needs_kv_cache_zeroing)
    return bool(getattr(fget, "__wrapped__", fget)(kv_cache_config))


# ---------------------------------------------------------------------- start-up record

_by_config = False
"""Whether an engine's config switched the guard on in this process (the plugin's
``activate(by_config=True)``), not the environment."""
_checked: tuple[int, int, str] | None = None
"""(``id`` of the vLLM config, workers, their block zeroing) of the last worker check
that passed in this process (the plugin's ``check_workers``): the engine core checks
its workers before it builds its scheduler."""


def note_activated(*, by_config: bool) -> None:
    """The plugin put the guard in force in this process (asked by a config or not)."""
    global _by_config
    _by_config = _by_config or by_config


def note_workers_checked(vllm_config: Any, workers: int, zeroing: str) -> None:
    """The engine core of ``vllm_config`` found its ``workers`` with the guard in force,
    zeroing blocks by ``zeroing``."""
    global _checked
    _checked = (id(vllm_config), workers, zeroing)


def worker_counts_per_request(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether vLLM's workers count NaN logits per request: the guard is in force in
    this process (the plugin's ``activate``, or ``KVGUARD_GUARD=1`` with the runners
    patched). An engine core started with the guard asked for checks every worker at
    start-up (``kvguard_report``) and refuses to start if one does not -- so here it is
    known unless the plugin did not run in this process (``VLLM_PLUGINS`` leaving
    ``kvguard`` out, or a scheduler built by hand)."""
    return (_by_config or requested(environ)) and worker_nans.installed()


def workers_checked(vllm_config: Any) -> int | None:
    """How many workers the engine core's check found with the guard in force for the
    engine of ``vllm_config``; None when it did not check them (a scheduler built
    without the plugin's start-up check, or a pooling model)."""
    if _checked is None or _checked[0] != id(vllm_config):
        return None
    return _checked[1]


def workers_zeroing(vllm_config: Any) -> str | None:
    """What zeroes blocks in the workers the engine core's check found (see
    :mod:`kvguard.adapters.vllm.workers.zeroing`); None when it did not check them."""
    if _checked is None or _checked[0] != id(vllm_config):
        return None
    return _checked[2]
