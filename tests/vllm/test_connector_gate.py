"""kvguard's gate for any KV connector, on vLLM's real scheduler and connectors:

* every connector vLLM ships is known to :data:`~kvguard.adapters.vllm.exits.coverage.COVERAGE`
  (a new one fails here), and those that save KV during the forward refuse the start,
  by name, before vLLM builds them;
* the request-finished gate, on vLLM's real ``NixlConnector`` (prefill side): a request
  that did not end after clean, counted steps -- its step had NaN, or came back
  without a NaN count -- sends nothing, and its client gets no transfer parameters;
  stock vLLM sends both. (NIXL's worker side, the transfer itself, runs in the
  real-engine prefill/decode tests over the example connector; here the tests play
  the workers.)
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

# (vLLM resolves NIXL's names while a config is being built; importing its wrapper
# first keeps that from running into a half-initialised module.)
import vllm.distributed.nixl_utils  # noqa: E402, F401
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector import factory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402

from kvguard.adapters.vllm.config import GuardConfigError  # noqa: E402
from kvguard.adapters.vllm.exits.coverage import (  # noqa: E402
    COVERAGE,
    DECLARED,
    GATED,
    Exit,
    coverage_of,
    refuse_ungated,
)
from kvguard.adapters.vllm.scheduler import guarded as scheduler_module  # noqa: E402

from .harness import BLOCK, make_request, make_scheduler, model_output, records_of  # noqa: E402

HAVE_NIXL = importlib.util.find_spec("nixl") is not None
needs_nixl = pytest.mark.skipif(
    not HAVE_NIXL, reason="NIXL's scheduler side imports nixl (nixl-cu12, see requirements/)"
)


def _shipped() -> set[str]:
    """The connectors vLLM's factory module registers (tests may register more)."""
    source = Path(factory.__file__).read_text()
    return set(re.findall(r'register_connector\(\s*"(\w+)"', source))


def test_every_connector_vllm_ships_is_covered() -> None:
    """A connector vLLM registers that kvguard does not know would be refused as
    unknown: this fails first, naming it, so the table is extended on purpose."""
    shipped = _shipped()
    assert {"ExampleConnector", "NixlConnector", "LMCacheConnectorV1"} <= shipped
    gated_by_subclass = {name for _, name in GATED}
    unknown = sorted(shipped - set(COVERAGE) - gated_by_subclass - {"MultiConnector"})
    assert not unknown, f"connectors vLLM ships that kvguard's COVERAGE does not name: {unknown}"


REFUSED = sorted(
    name
    for name, coverage in COVERAGE.items()
    if coverage.exit is Exit.REFUSED and name in _shipped()
)


def _config(name: str, multi: bool) -> KVTransferConfig:
    child = {"kv_connector": name, "kv_role": "kv_both"}
    if not multi:
        return KVTransferConfig(**child)
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": [child]},
    )


@pytest.mark.parametrize("multi", [False, True], ids=["alone", "multi"])
@pytest.mark.parametrize("name", REFUSED)
def test_a_connector_saving_during_the_forward_refuses_the_start(name: str, multi: bool) -> None:
    """Refused from the config -- the guarded scheduler's first act, before vLLM builds
    the connector (some do not even import without their package): the message names
    the connector and what to run instead."""
    with pytest.raises(GuardConfigError, match=f"KV connector {name}: ") as e:
        refuse_ungated(_config(name, multi))
    assert "KVGUARD_GUARD=0" in str(e.value)


@pytest.mark.parametrize("name", ["MooncakeStoreConnector", "ExampleHiddenStatesConnector"])
def test_the_guarded_scheduler_refuses_before_building_the_connector(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On vLLM's scheduler (two connectors whose config vLLM builds here): the start
    is refused, and vLLM never got to build the connector."""
    built: list[Any] = []
    monkeypatch.setattr(
        KVConnectorFactory, "create_connector", classmethod(lambda *a, **k: built.append(a))
    )
    with pytest.raises(GuardConfigError, match=f"KV connector {name}"):
        make_scheduler(kv_transfer_config=_config(name, multi=False))
    assert not built


def test_an_unknown_connector_is_refused_unless_it_declares_its_exit() -> None:
    refused = coverage_of("MyConnector", "my.connectors", {})
    assert refused.exit is Exit.REFUSED and DECLARED in refused.why
    assert coverage_of("MyConnector", "my.connectors", {DECLARED: "request_finished"}).exit is (
        Exit.AT_FINISH
    )
    assert coverage_of("MyConnector", "my.connectors", {DECLARED: "loads_only"}).exit is (
        Exit.LOADS_ONLY
    )
    # A vLLM name does not make an out-of-tree class vLLM's.
    assert coverage_of("NixlConnector", "my.connectors", {}).exit is Exit.REFUSED


@pytest.mark.parametrize(
    ("name", "extra", "role", "exit_"),
    [
        ("MooncakeStoreConnector", {}, "kv_both", Exit.REFUSED),
        ("MooncakeStoreConnector", {}, "kv_consumer", Exit.LOADS_ONLY),
        ("LMCacheMPConnector", {}, "kv_consumer", Exit.REFUSED),
        ("MoRIIOConnector", {}, "kv_producer", Exit.REFUSED),
        ("MoRIIOConnector", {"read_mode": "true"}, "kv_producer", Exit.AT_FINISH),
        ("MoRIIOConnector", {"read_mode": True}, "kv_producer", Exit.AT_FINISH),
    ],
)
def test_the_setting_that_makes_a_connector_gateable(
    name: str, extra: dict[str, Any], role: str, exit_: Exit
) -> None:
    """A decode-side Mooncake store saves nothing (loads only); MoRIIO in
    read mode ships only finished requests' blocks. The refusal names the setting."""
    assert coverage_of(name, None, extra, role).exit is exit_
    if exit_ is Exit.REFUSED and name != "LMCacheMPConnector":
        assert ("kv_consumer" in coverage_of(name, None, {}, "kv_both").why) or (
            "read_mode" in coverage_of(name, None, {}, role).why
        )
    config = KVTransferConfig(kv_connector=name, kv_role=role, kv_connector_extra_config=extra)
    if exit_ is Exit.REFUSED:
        with pytest.raises(GuardConfigError, match=name):
            refuse_ungated(config)
    else:
        refuse_ungated(config)


# ---------------------------------------------------------------- request finished


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``caplog`` gets what the guarded scheduler and the connector log."""
    from kvguard.adapters.vllm.exits import gate

    with records_of([scheduler_module.logger, gate.logger], caplog, monkeypatch):
        yield


HAVE_MOONCAKE_MODULE = all(
    importlib.util.find_spec(name) is not None for name in ("msgpack", "uvicorn")
)
P_D = [
    pytest.param("NixlConnector", marks=needs_nixl),
    pytest.param(
        "MooncakeConnector",
        marks=pytest.mark.skipif(
            not HAVE_MOONCAKE_MODULE,
            reason="vLLM's Mooncake module imports msgpack and uvicorn (see requirements/)",
        ),
    ),
]
"""The prefill/decode connectors whose scheduler side builds here."""


def _p_d(name: str, **kwargs: Any) -> Any:
    """A prefill instance's scheduler with the connector ``name``."""
    role = "kv_both" if name == "NixlConnector" else "kv_producer"
    return make_scheduler(
        kv_transfer_config=KVTransferConfig(kv_connector=name, kv_role=role), **kwargs
    )


def _prefill(s: Any, request_id: str, outcome: str) -> tuple[str, dict[str, Any] | None]:
    """A prefill-instance request (max_tokens 1, ``do_remote_decode``) run to its end;
    its one step ``clean``, with a NaN (``nan``) or without a NaN count
    (``unchecked``). Returns its finish reason and the transfer parameters its client
    gets (what a proxy hands the decode instance)."""
    request = make_request(request_id, list(range(100, 100 + 3 * BLOCK)), max_tokens=1)
    request.kv_transfer_params = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": f"xfer-{request_id}",  # (Mooncake's)
    }
    s.add_request(request)
    so = s.schedule()
    mo = model_output(s, so, {request_id: 1} if outcome == "nan" else None)
    if outcome == "unchecked":
        del mo.num_nans_in_logits[request_id]
    out = s.update_from_output(so, mo)
    (finished,) = [o for eco in out.values() for o in eco.outputs if o.finish_reason]
    return str(finished.finish_reason), finished.kv_transfer_params


def _held(s: Any, request_id: str) -> bool:
    """Whether vLLM keeps the finished request's blocks for the decode instance to read
    (``request_finished`` asked it to delay their free)."""
    return any(
        request_id in manager.req_to_blocks
        for manager in s.kv_cache_manager.coordinator.single_type_managers
    )


def _handed_over(s: Any, request_id: str, params: dict[str, Any] | None) -> bool:
    """Whether the request was handed to the decode side: its blocks kept for the
    transfer, and (NIXL) the parameters a proxy passes on."""
    if type(s.connector).__name__.startswith("Nixl") and _held(s, request_id):
        assert params is not None and params["remote_block_ids"]
    return _held(s, request_id)


@pytest.mark.parametrize("name", P_D)
@pytest.mark.usefixtures("log")
def test_p_d_sends_only_requests_that_ended_after_clean_counted_steps(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    s = _p_d(name)
    reason, params = _prefill(s, "clean", "clean")
    assert reason == "length" and _handed_over(s, "clean", params)
    reason, params = _prefill(s, "nan", "nan")
    assert reason == "error" and params is None and not _handed_over(s, "nan", params)
    reason, params = _prefill(s, "unchecked", "unchecked")
    assert reason == "length" and params is None and not _handed_over(s, "unchecked", params)
    assert s.kvguard_stats()["connector_handoffs_withheld"] == 1
    (warning,) = [r for r in caplog.records if "not handed to the KV connector" in r.message]
    assert "unchecked" in warning.getMessage()
    line = next(r.getMessage() for r in caplog.records if "guard in force" in r.getMessage())
    assert f"connectors gated: {type(s.connector).__name__} (at request_finished)" in line


@pytest.mark.parametrize("name", P_D)
def test_stock_p_d_sends_a_failed_or_unchecked_request(name: str) -> None:
    """The same requests on stock vLLM: all three are handed over."""
    s = _p_d(name, guarded=False)
    for request_id in ("clean", "nan", "unchecked"):
        reason, params = _prefill(s, request_id, request_id)
        assert reason == "length" and _handed_over(s, request_id, params)


@pytest.mark.parametrize("name", P_D)
def test_p_d_inside_a_multi_connector_is_gated(name: str) -> None:
    role = "kv_both" if name == "NixlConnector" else "kv_producer"
    s = make_scheduler(
        kv_transfer_config=KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role=role,
            kv_connector_extra_config={"connectors": [{"kv_connector": name, "kv_role": role}]},
        )
    )
    for request_id in ("nan", "unchecked"):
        _prefill(s, request_id, request_id)
        assert not _held(s, request_id)
    _prefill(s, "clean", "clean")
    assert _held(s, "clean")
