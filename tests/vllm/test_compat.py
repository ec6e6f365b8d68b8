"""The supported vLLM series and the one module that knows their differences.

The version check needs no vLLM (it runs in the main suite too); the helpers are
checked against the installed vLLM, whichever supported series it is."""

from __future__ import annotations

import importlib.util
import re

import pytest

from kvguard.adapters.vllm._compat import (
    SUPPORTED,
    UnsupportedVllmError,
    check_vllm_version,
    series_of,
)

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs the real vllm package"
)


@pytest.mark.parametrize(
    ("version", "series"),
    [
        ("0.33.0", "0.33"),
        ("0.32.0+cpu", "0.32"),
        ("0.33.1rc1", "0.33"),
        ("0.32", "0.32"),
        ("0.34.0", "0.34"),
    ],
)
def test_series_of(version: str, series: str) -> None:
    assert series_of(version) == series


@pytest.mark.parametrize(
    "version", ["0.32.0", "0.32.0+cpu", "0.32.3", "0.33.0", "0.33.2", "0.34.0", "0.34.1rc1"]
)
def test_the_three_series_are_accepted(version: str) -> None:
    assert SUPPORTED == ("0.32", "0.33", "0.34")
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.1", "0.35.0", "1.0.0", "0.3.2"])
def test_other_series_are_refused_by_name(version: str) -> None:
    expected = r"vLLM 0\.32\.x, 0\.33\.x, 0\.34\.x; found vllm==" + re.escape(version)
    with pytest.raises(UnsupportedVllmError, match=expected):
        check_vllm_version(version)


@needs_vllm
@pytest.mark.vllm
def test_block_pool_kwargs_rebuild_vllms_pool_on_the_installed_series() -> None:
    """What install_guarded_pool builds from vLLM's pool is configured like it, on
    every series' constructor (0.33 adds num_hash_lookahead_tokens)."""
    import vllm
    from vllm.v1.core.block_pool import BlockPool

    from kvguard.adapters.vllm import GuardConfig, GuardedBlockPool
    from kvguard.adapters.vllm._compat import (
        block_pool_kwargs,
        has_lookahead_hashes,
        hash_lookahead_tokens,
    )

    stock = BlockPool(12, True, 16, True, None, medium="GPU")
    kwargs = block_pool_kwargs(stock)
    lookahead = series_of(vllm.__version__) != "0.32"
    assert ("num_hash_lookahead_tokens" in kwargs) is lookahead
    assert has_lookahead_hashes() is lookahead
    pool = GuardedBlockPool(**kwargs, guard=GuardConfig())
    assert block_pool_kwargs(pool) == kwargs
    assert hash_lookahead_tokens(pool) == 0


@needs_vllm
@pytest.mark.vllm
def test_guarded_blocks_name_their_pool_as_vllms_own_blocks_do() -> None:
    """vLLM routes a free by ``block.pool`` (0.34: a weak reference it calls): the
    guarded pool's blocks carry what vLLM's own pool gives its blocks, on the
    installed series."""
    from vllm.v1.core.block_pool import BlockPool

    from kvguard.adapters.vllm import GuardConfig, GuardedBlockPool
    from kvguard.adapters.vllm._compat import block_pool_kwargs, owning_pool

    stock = BlockPool(12, True, 16, True, None, medium="GPU")
    pool = GuardedBlockPool(**block_pool_kwargs(stock), guard=GuardConfig())
    (stock_block,) = stock.get_new_blocks(1)
    (block,) = pool.get_new_blocks(1)
    assert isinstance(block.pool, type(stock_block.pool))  # the pool, or a weakref to it
    assert owning_pool(stock_block) is stock
    assert owning_pool(block) is pool
    # vLLM's pool routes a guarded block back to its pool, as it routes its own.
    stock.free_blocks([block])
    assert block.ref_cnt == 0
    pool.check_consistency()
