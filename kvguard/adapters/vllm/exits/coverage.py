"""Every KV connector under a guarded scheduler: gated, or refused at start-up.

KV leaves (or enters) an instance through a connector at one of three moments, and
that moment decides how kvguard can gate it:

* **copies the scheduler side picks** (vLLM's CPU offloading, SimpleCPU offloading,
  the example connector's shared storage, LMCache's saves): kvguard's subclass of the
  connector copies, makes visible or asks its workers to save only blocks whose steps
  validated, through the exit gate (:mod:`.gate`); the plugin substitutes it for
  vLLM's class (:data:`GATED`). vLLM's own class under a guarded scheduler is refused,
  naming the subclass.
* **KV of a finished request**, shipped from ``request_finished`` (prefill/decode:
  NIXL, Mooncake, MoRIIO in read mode): the request-finished gate
  (:func:`.gate.withhold_from_connector`) shows the connector a request that did not
  end after clean, counted steps as aborted, so it sends and keeps nothing of it, and
  hands the client no transfer parameters.
* **KV saved by the workers during the forward**, before the step's NaN count exists
  (LMCache's multiprocess server, Mooncake's and UMBP's stores, HF3FS, FlexKV, ...):
  nothing on the scheduler side can hold such a save back, and these stores offer the
  scheduler no delete. They are refused at start-up, with the reason and what to run instead.

KV a connector *loads* is gated for every connector alike by the guarded scheduler:
the blocks it fills are WRITTEN until a step of the request, computing on them, is
counted clean. :data:`COVERAGE` names every connector vLLM ships (0.32 to 0.34); a
connector not in it (``kv_connector_module_path``) is refused unless its
``kv_connector_extra_config`` declares ``"kvguard_exit": "request_finished"`` -- that it
ships KV only from ``request_finished`` -- or ``"loads_only"``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvguard.adapters.vllm.config import GuardConfigError


class Exit(enum.Enum):
    """When a connector's KV leaves the instance, as far as kvguard can gate it."""

    GATED = "gated"
    """kvguard's subclass: it copies or exposes validated blocks only."""
    AT_FINISH = "request_finished"
    """KV of finished requests, from ``request_finished``: the request-finished gate."""
    LOADS_ONLY = "loads_only"
    """Brings KV in, never out (loads wait for a step to vouch for them)."""
    IN_INSTANCE = "in_instance"
    """Copies stay with their request inside the instance: nothing else reads them."""
    REFUSED = "refused"
    """Copies kvguard cannot gate: the engine refuses to start."""


@dataclass(frozen=True, slots=True)
class Coverage:
    exit: Exit
    why: str = ""
    """For a refused connector: what it does that kvguard cannot gate, and what to
    run instead."""
    as_consumer: Exit | None = None
    """Its exit as a decode-side instance (``kv_role="kv_consumer"``: it saves nothing)."""
    setting: tuple[str, str] | None = None
    """A ``kv_connector_extra_config`` (key, value) under which its KV leaves only from
    ``request_finished``."""
    replaces: tuple[str, str] | None = None
    """For kvguard's gated class: vLLM's class it stands for (module, name)."""


_NO_DELETE = (
    "and its store offers the scheduler no delete, so kvguard can neither hold a save "
    "back nor withdraw a failed one"
)
_FORWARD_SAVE = (
    f"its workers save KV during the forward, before the step's NaN count exists, {_NO_DELETE}"
)
_INSTEAD = (
    "Use vLLM's OffloadingConnector or SimpleCPUOffloadConnector (gated) for a CPU tier, "
    "ExampleConnector (gated) for shared storage, NixlConnector or MooncakeConnector for "
    "prefill/decode; or run this connector unguarded (KVGUARD_GUARD=0)"
)
_AS_CONSUMER = 'As a decode instance (kv_role="kv_consumer") it saves nothing and is gated'


def _refused(why: str, *, consumer: bool = False) -> Coverage:
    if consumer:
        return Coverage(Exit.REFUSED, f"{why}. {_AS_CONSUMER}. {_INSTEAD}", Exit.LOADS_ONLY)
    return Coverage(Exit.REFUSED, f"{why}. {_INSTEAD}")


_V1 = "vllm.distributed.kv_transfer.kv_connector.v1"


def _gated(module: str, name: str) -> Coverage:
    return Coverage(Exit.GATED, replaces=(f"{_V1}.{module}", name))


COVERAGE: dict[str, Coverage] = {
    # kvguard's subclasses, gated through the exit gate, each in place of vLLM's class.
    "GuardedOffloadingConnector": _gated("offloading_connector", "OffloadingConnector"),
    "GuardedSimpleCPUOffloadConnector": _gated(
        "simple_cpu_offload_connector", "SimpleCPUOffloadConnector"
    ),
    "GuardedExampleConnector": _gated("example_connector", "ExampleConnector"),
    "GuardedLMCacheConnectorV1": _gated("lmcache_connector", "LMCacheConnectorV1"),
    # Prefill/decode: the decode instance reads (or is sent) a finished request's
    # blocks; each sends only for a request that ended normally.
    "NixlConnector": Coverage(Exit.AT_FINISH),
    "NixlPullConnector": Coverage(Exit.AT_FINISH),
    "NixlPushConnector": Coverage(Exit.AT_FINISH),
    "MooncakeConnector": Coverage(Exit.AT_FINISH),
    "MoRIIOConnector": Coverage(
        Exit.REFUSED,
        "in its default write mode its workers write each request's KV into the decode "
        "instance during the forward, before the step's NaN count exists. Set "
        '"read_mode": true in its kv_connector_extra_config: the decode instance then '
        f"reads a finished request's blocks, which kvguard gates. {_INSTEAD}",
        Exit.AT_FINISH,
        ("read_mode", "true"),
    ),
    # KV in, none out; or copies that never leave their request.
    "DecodeBenchConnector": Coverage(Exit.LOADS_ONLY),
    "HiSparseConnector": Coverage(Exit.IN_INSTANCE),
    # Saved from the forward, or whatever the request's steps computed.
    "LMCacheMPConnector": _refused(
        "its workers send each step's KV to the LMCache server right after the forward, "
        f"before the step's NaN count exists, {_NO_DELETE}"
    ),
    "MooncakeStoreConnector": _refused(_FORWARD_SAVE, consumer=True),
    "UMBPStoreConnector": _refused(_FORWARD_SAVE, consumer=True),
    "HF3FSKVConnector": _refused(_FORWARD_SAVE),
    "FlexKVConnectorV1": _refused(
        "its copies are made by the external flexkv package, whose timing and deletes "
        "kvguard cannot check"
    ),
    "ExampleHiddenStatesConnector": _refused(
        "it writes the hidden states of every finished request, whatever its steps "
        "computed (a failed step's included), before the step's NaN count exists"
    ),
}
"""Every connector vLLM ships (0.32 to 0.34), and kvguard's gated classes, by name."""

MODULE_PATH = "kvguard.adapters.vllm"
"""The ``kv_connector_module_path`` of kvguard's gated classes: the package exports each
(lazily), whichever file defines it."""

GATED: dict[tuple[str, str], str] = {
    coverage.replaces: name for name, coverage in COVERAGE.items() if coverage.replaces
}
"""vLLM's connector classes (module, name) whose copies kvguard gates -> the name of the
gated class the plugin gives in their place (in :data:`MODULE_PATH`)."""

DECLARED = "kvguard_exit"
"""The ``kv_connector_extra_config`` key by which a connector kvguard does not know
declares when its KV leaves: ``"request_finished"`` or ``"loads_only"``."""


def refuse_ungated(kv_transfer_config: Any) -> None:
    """Refuse to start (:class:`GuardConfigError`) if a configured connector's copies
    cannot be gated, naming the connector and what to run instead. Read from the
    config, before vLLM builds a connector (a refused one may not even import)."""
    if kv_transfer_config is None or kv_transfer_config.kv_connector is None:
        return
    for name, module_path, extra, role in configured_connectors(kv_transfer_config):
        coverage = coverage_of(name, module_path, extra, role)
        if coverage.exit is Exit.REFUSED:
            raise GuardConfigError(f"kvguard cannot gate the KV connector {name}: {coverage.why}.")


def configured_connectors(
    kv_transfer_config: Any,
) -> Iterator[tuple[str, str | None, dict[str, Any], str | None]]:
    """(name, module path, extra config, kv role) of each connector configured, a
    ``MultiConnector``'s children in its place."""
    yield from _entries(
        kv_transfer_config.kv_connector,
        kv_transfer_config.kv_connector_module_path,
        dict(kv_transfer_config.kv_connector_extra_config or {}),
        kv_transfer_config.kv_role,
    )


def _entries(
    name: str, module_path: str | None, extra: dict[str, Any], role: str | None
) -> Iterator[tuple[str, str | None, dict[str, Any], str | None]]:
    if name == "MultiConnector" and not module_path:
        for child in extra.get("connectors", ()):
            yield from _entries(
                child.get("kv_connector"),
                child.get("kv_connector_module_path"),
                dict(child.get("kv_connector_extra_config") or {}),
                child.get("kv_role", role),
            )
        return
    yield name, module_path, extra, role


def coverage_of(
    name: str, module_path: str | None, extra: dict[str, Any], role: str | None = None
) -> Coverage:
    """How kvguard gates the connector configured as ``name`` (``module_path``: an
    out-of-tree module, or None for vLLM's registry) with its extra config and
    ``kv_role``."""
    vllm_name = module_path is None or module_path.startswith("vllm.")
    if vllm_name and name in {cls for _, cls in GATED}:
        # vLLM's class with a gated subclass: the plugin's factory substitutes it.
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        config = _Named(name, module_path)
        cls = KVConnectorFactory.get_connector_class(config)
        if cls.__module__.startswith("kvguard."):
            return Coverage(Exit.GATED)
        guarded = GATED[(cls.__module__, cls.__name__)]
        return Coverage(
            Exit.REFUSED,
            "vLLM's own class copies KV of steps that are not validated yet. Use "
            f"kv_connector='{guarded}' (kv_connector_module_path='{MODULE_PATH}'), or start "
            "vLLM with KVGUARD_GUARD=1, which selects it for you",
        )
    if vllm_name or str(module_path).startswith("kvguard."):
        known = COVERAGE.get(name)
        if known is not None:
            return _as_configured(known, extra, role)
    declared = extra.get(DECLARED)
    for exit_ in (Exit.AT_FINISH, Exit.LOADS_ONLY):
        if declared == exit_.value:
            return Coverage(exit_)
    return Coverage(
        Exit.REFUSED,
        "kvguard does not know when this connector copies KV. If it ships KV only from "
        "request_finished, or only loads KV, declare it in its kv_connector_extra_config: "
        f'{{"{DECLARED}": "request_finished"}} (or "loads_only"); otherwise run it '
        "unguarded (KVGUARD_GUARD=0)",
    )


_SHOWN = {
    Exit.AT_FINISH: "at request_finished",
    Exit.LOADS_ONLY: "loads only",
    Exit.IN_INSTANCE: "copies stay with their request",
}


def gate_of(connector: Any) -> str:
    """A built connector as the start-up line names it: its class, and how it is
    gated unless by a subclass of kvguard's (which counts its copies)."""
    name = type(connector).__name__
    if hasattr(connector, "kvguard_stats"):
        return name
    known = COVERAGE.get(name)
    config = getattr(connector, "_kv_transfer_config", None)
    extra = getattr(config, "kv_connector_extra_config", None) or {}
    role = getattr(config, "kv_role", None)
    exit_ = (
        _as_configured(known, extra, role).exit
        if known is not None
        else Exit(extra.get(DECLARED, "refused"))
    )
    return f"{name} ({_SHOWN.get(exit_, exit_.value)})"


def _as_configured(coverage: Coverage, extra: dict[str, Any], role: str | None) -> Coverage:
    """``coverage`` under the connector's settings."""
    if coverage.exit is not Exit.REFUSED:
        return coverage
    if coverage.setting is not None:
        key, value = coverage.setting
        if str(extra.get(key, "")).strip().lower() in (value, "1"):
            return Coverage(Exit.AT_FINISH)
    elif role == "kv_consumer" and coverage.as_consumer is not None:
        return Coverage(coverage.as_consumer)
    return coverage


@dataclass(frozen=True, slots=True)
class _Named:
    """What vLLM's connector factory reads of a ``KVTransferConfig``."""

    kv_connector: str
    kv_connector_module_path: str | None
