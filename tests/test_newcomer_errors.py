"""What a new user meets first: the README's and the docs' snippets run as written (a
prompt seen twice included), integer-likes are taken wherever an int is, and each
misuse error says what is wrong and what to do -- leaving the pool as it was."""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import kvguard.pool
from kvguard import (
    BlockHash,
    BlockPool,
    DoubleFreeError,
    ForeignBlockError,
    KvGuardError,
    NotAllocatedError,
    NotStorableError,
    OutOfBlocksError,
    PoolMisuseError,
    PrefixHit,
    RequestAbortedError,
    RollbackError,
    StoreTicket,
    UnknownBlockError,
    UnknownRequestError,
    UnknownTicketError,
)

from .conftest import make_pool
from .test_bad_input import World, entry_points

ROOT = Path(__file__).parent.parent


class Index:
    """An integer-like that is not an int: ``__index__`` only (no int hash or
    equality, so one that leaked into the pool's tables would never be found)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"Index({self.value})"


class BrokenIndex:
    def __index__(self) -> int:
        raise ZeroDivisionError("broken")


# ------------------------------------------------------------ the snippets, as written


def _python_block(text: str, after: str) -> str:
    block = re.search(r"```python\n(.*?)```", text.split(after, 1)[1], re.S)
    assert block is not None, f"no python block after {after!r}"
    return block.group(1)


README_SNIPPET = _python_block((ROOT / "README.md").read_text(), "In your own engine")


def test_readme_snippet_runs_as_written_for_a_prompt_seen_twice() -> None:
    """The snippet serves one prompt twice: the second time, every block of it is
    cached, and the snippet's lookup leaves the last prompt token for the step."""
    for _ in range(2):  # (twice from scratch, too: nothing is left behind)
        namespace: dict[str, Any] = {}
        exec(compile(README_SNIPPET, "README.md", "exec"), namespace)
        pool: BlockPool = namespace["pool"]
        prompt = namespace["prompt_token_ids"]
        assert len(prompt) % pool.block_size == 0, "the point: a prompt of full blocks"
        assert namespace["rid"] == "r2"
        assert namespace["hit"].num_tokens == len(prompt) - pool.block_size
        assert pool.request_ids == ()
        pool.check_invariants()


def test_readme_snippet_without_the_cap_fails_saying_what_to_do() -> None:
    """Without ``max_tokens`` the second, fully cached prompt has no token left to
    write; the error says how to keep one."""
    capped = "pool.lookup(rid, max_tokens=len(prompt_token_ids) - 1)"
    assert capped in README_SNIPPET
    uncapped = README_SNIPPET.replace(capped, "pool.lookup(rid)")
    with pytest.raises(PoolMisuseError) as info:
        exec(compile(uncapped, "README.md (uncapped)", "exec"), {})
    message = str(info.value)
    assert "write('r2', 0)" in message
    assert "covers the whole prompt (48 tokens)" in message
    assert "keep the last prompt token out of the hit, as vLLM does" in message
    assert "lookup('r2', max_tokens=47)" in message


def test_docs_api_snippet_runs_as_written() -> None:
    snippet = _python_block((ROOT / "docs" / "api.md").read_text(), "## A worked example")
    assert "max_tokens=len(prompt) - 1" in snippet
    namespace: dict[str, Any] = {}
    exec(compile(snippet, "docs/api.md", "exec"), namespace)
    namespace["pool"].check_invariants()


def test_pool_docstring_snippet_runs_for_a_prompt_seen_twice() -> None:
    doc = kvguard.pool.__doc__
    assert doc is not None
    snippet = textwrap.dedent(doc.split("::\n", 1)[1].split("\n\n", 1)[0])
    snippet = snippet.replace("    ...", "    pass")
    pool = BlockPool(64, 16, check_invariants=True)
    namespace: dict[str, Any] = {"pool": pool, "prompt_token_ids": list(range(32))}
    for _ in range(2):
        exec(compile(snippet, "kvguard/pool.py", "exec"), namespace)
    assert namespace["hit"].num_tokens == 16  # the second time: all but the last block


def test_pool_demo_runs() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(ROOT / "examples" / "pool_demo.py"), run_name="__main__")
    assert "B now hits 64 tokens" in out.getvalue()


# ------------------------------------------------------------ integer-likes


def _outcome(call: Callable[[], object]) -> tuple[str, str]:
    try:
        result = call()
    except KvGuardError as exc:
        return type(exc).__name__, str(exc)
    if isinstance(result, Iterator):  # (free_block_ids)
        result = list(result)
    return "ok", repr(result)


def _as_index(value: object) -> object:
    if type(value) is int:
        return Index(value)
    if isinstance(value, (list, tuple)):
        return type(value)(Index(v) for v in value)
    return value


# Ints for the arguments whose valid value in the sweep is None or empty.
INT_VALUES = {
    ("lookup", "max_tokens"): 9,
    ("zero_request_tail", "num_tokens"): 2,
    ("reset_prefix_cache", "keep_held"): [0],
    ("free_block_ids", "after"): 1,
}
INTEGER_ARGS = [
    (method, arg)
    for method, args in sorted(entry_points(World()).items())
    for arg, (kind, value) in sorted(args.items())
    if kind in ("count", "optional_count", "retention", "ids")
]


def test_the_integer_sweep_covers_every_int_argument() -> None:
    assert len(INTEGER_ARGS) == 21
    valid = entry_points(World())
    for method, arg in INTEGER_ARGS:
        value = INT_VALUES.get((method, arg), valid[method][arg][1])
        assert _as_index(value) != value, (method, arg)


@pytest.mark.parametrize("compiled", [True, False], ids=["C", "python"])
@pytest.mark.parametrize(("method", "arg"), INTEGER_ARGS)
def test_integer_likes_do_what_the_int_does(
    method: str, arg: str, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each int argument given as an integer-like (ids: a list of them): the same
    result (no integer-like in it), the same error, the same pool afterwards."""
    from kvguard.fast_path import PURE_PYTHON_ENV, available

    if compiled:
        monkeypatch.delenv(PURE_PYTHON_ENV, raising=False)
        if not available():
            pytest.skip("kvguard._speedups is not built")
    else:
        monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    with_int, with_index = World(), World()
    args = {a: v for a, (_, v) in entry_points(with_int)[method].items()}
    args[arg] = INT_VALUES.get((method, arg), args[arg])
    expected = _outcome(lambda: getattr(with_int.pool, method)(**args))
    args = {a: v for a, (_, v) in entry_points(with_index)[method].items()}
    args[arg] = _as_index(INT_VALUES.get((method, arg), args[arg]))
    assert _outcome(lambda: getattr(with_index.pool, method)(**args)) == expected
    assert with_index.pool.snapshot() == with_int.pool.snapshot()
    with_index.pool.check_invariants()


def test_numpy_integers_are_taken_wherever_an_int_is() -> None:
    np = pytest.importorskip("numpy")
    pool = BlockPool(np.int64(16), np.int32(4), check_invariants=True)
    pool.add_request("a", np.arange(8), retention=np.int8(1))
    hit = pool.lookup("a", max_tokens=np.int64(7))
    assert pool.can_allocate("a", np.int64(8), hit=hit)
    new = pool.allocate("a", np.int64(8), hit=hit)
    assert all(type(b) is int for b in new)
    pool.write("a", np.uint16(8))
    pool.validate_step("a")
    info = pool.block_info(np.int64(new[0]))
    assert info.block_id == new[0] and type(info.block_id) is int
    assert pool.block_state(np.int64(new[0])) is info.state
    ticket = pool.begin_store(np.int64(new[0]), "cpu")
    assert type(ticket.block_id) is int
    held = np.array(pool.allocate_blocks(np.int64(2), write=True))
    validation = pool.validate_blocks(held, publish={held[0]: (BlockHash(b"h" * 16), None, "x")})
    assert validation.published == (int(held[0]),)
    pool.release_blocks(held)
    assert pool.zero_request_tail("a", np.int64(0)).num_tokens == 8


def test_integers_that_are_not_ints_are_refused_naming_their_type() -> None:
    pool: Any = make_pool()  # (untyped: the calls pass what the types forbid)
    untyped_pool: Any = BlockPool
    pool.add_request("a", [1, 2, 3])
    cases: list[tuple[Callable[[], object], type[KvGuardError], str]] = [
        (lambda: pool.allocate("a", 1.0), PoolMisuseError, "1.0 (float)"),
        (lambda: pool.allocate("a", True), PoolMisuseError, "True (bool)"),
        (lambda: pool.allocate("a", "3"), PoolMisuseError, "'3' (str)"),
        (lambda: pool.allocate("a", BrokenIndex()), PoolMisuseError, "ZeroDivisionError"),
        (lambda: pool.block_info(3.0), UnknownBlockError, "3.0 (float)"),
        (lambda: pool.block_info(True), UnknownBlockError, "True (bool)"),
        (lambda: pool.block_info(BrokenIndex()), PoolMisuseError, "ZeroDivisionError"),
        (lambda: pool.release_blocks([1, "x"]), UnknownBlockError, "'x' (str)"),
        (lambda: pool.acquire_blocks([None]), UnknownBlockError, "None (NoneType)"),
        (lambda: pool.validate_blocks([False]), UnknownBlockError, "False (bool)"),
        (lambda: pool.fail_blocks([2.5]), UnknownBlockError, "2.5 (float)"),
        (lambda: pool.add_request("b", retention=0.5), PoolMisuseError, "0.5 (float)"),
        (lambda: untyped_pool(16.0, 4), PoolMisuseError, "16.0 (float)"),
        (
            lambda: pool.validate_blocks([], publish={True: (b"h", None, "")}),
            PoolMisuseError,
            "True (bool)",
        ),
    ]
    for call, error, named in cases:
        before = pool.snapshot()
        with pytest.raises(error) as info:
            call()
        assert named in str(info.value), str(info.value)
        assert "int" in str(info.value), str(info.value)
        assert pool.snapshot() == before
    pool.check_invariants()


def test_numpy_bool_is_refused() -> None:
    np = pytest.importorskip("numpy")
    pool = make_pool()
    pool.add_request("a", [1, 2, 3])
    with pytest.raises(PoolMisuseError, match=r"numpy\.bool"):
        pool.allocate("a", np.bool_(True))


def test_publish_keys_that_name_one_block_twice_are_refused() -> None:
    pool: Any = make_pool()
    (block,) = pool.allocate_blocks(1, write=True)
    before = pool.snapshot()
    publication = (b"h" * 16, None, "")
    with pytest.raises(PoolMisuseError, match=f"publish names block {block} twice"):
        pool.validate_blocks([block], publish={block: publication, Index(block): publication})
    assert pool.snapshot() == before


# ------------------------------------------------------------ one test per message


def _fully_cached(pool: BlockPool, rid: str) -> None:
    """``rid``'s 16-token prompt is cached whole, and ``rid`` took the whole hit."""
    prompt = list(range(16))
    pool.add_request("first", prompt)
    pool.allocate("first", 16)
    pool.write("first", 16)
    pool.validate_step("first")
    pool.add_request(rid, prompt)
    hit = pool.lookup(rid)
    assert hit.num_tokens == 16
    pool.allocate(rid, 16, hit=hit)


def _written(pool: BlockPool, rid: str, n: int) -> None:
    pool.add_request(rid, list(range(100, 100 + n)))
    pool.allocate(rid, n)
    pool.write(rid, n)


def _hashed_full_hit(pool: BlockPool) -> None:
    """A request opened with block hashes only (no prompt token ids) takes a whole
    hit."""
    pool.add_request("first", list(range(8)))
    pool.allocate("first", 8)
    pool.write("first", 8)
    pool.validate_step("first")
    hashes = [pool.block_hash(b) for b in pool.block_table("first")]
    pool.add_request("h", block_hashes=hashes)  # type: ignore[arg-type]
    hit = pool.lookup("h")
    assert hit.num_tokens == 8
    pool.allocate("h", 8, hit=hit)


def _aborted(pool: BlockPool) -> None:
    _written(pool, "x", 6)
    pool.validate_step("x")
    pool.allocate("x", 7)
    pool.write("x", 1)
    pool.fail_step("x")


def _published_block(pool: BlockPool) -> int:
    _written(pool, "p", 4)
    pool.validate_step("p")
    return pool.block_table("p")[0]


def _fully_cached_looked_up(pool: BlockPool) -> None:
    """A 16-token prompt cached whole; request ``r`` opened on it."""
    prompt = list(range(16))
    pool.add_request("first", prompt)
    pool.allocate("first", 16)
    pool.write("first", 16)
    pool.validate_step("first")
    pool.add_request("r", prompt)


def _whole_prompt_hit(pool: BlockPool) -> PrefixHit:
    _fully_cached_looked_up(pool)
    return pool.lookup("r")


def _another_requests_hit(pool: BlockPool) -> PrefixHit:
    _fully_cached_looked_up(pool)
    pool.add_request("other", [1])
    return pool.lookup("r")


def _hit_after_blocks(pool: BlockPool) -> PrefixHit:
    _written(pool, "a", 2)
    return pool.lookup("a")


def _freed(pool: BlockPool) -> None:
    _written(pool, "a", 2)
    pool.free("a")


def _computed_whole_prompt_then_looked_up(pool: BlockPool) -> None:
    """``r`` computed its whole prompt itself, then looked it up: a whole hit it does
    not hold."""
    _fully_cached_looked_up(pool)
    pool.allocate("r", 16)
    pool.write("r", 16)
    pool.validate_step("r")
    assert pool.lookup("r").num_tokens == 16


def _settled_ticket(pool: BlockPool) -> StoreTicket:
    ticket = pool.begin_store(_published_block(pool))
    pool.fail_store(ticket)
    return ticket


# (name, setup, call, error, what the message must say)
# (untyped: the calls pass what the types forbid)
Setup = Callable[[Any], object]
Call = Callable[[Any, Any], object]  # (the pool, what setup returned)
MESSAGES: list[tuple[str, Setup, Call, type[KvGuardError], tuple[str, ...]]] = [
    (
        "write(0) after a hit on the whole prompt",
        lambda p: _fully_cached(p, "r"),
        lambda p, c: p.write("r", 0),
        PoolMisuseError,
        (
            "write('r', 0)",
            "prefix hit covers the whole prompt (16 tokens)",
            "keep the last prompt token out of the hit, as vLLM does",
            "lookup('r', max_tokens=15)",
        ),
    ),
    (
        "write(0) after a whole hit of hashes",
        _hashed_full_hit,
        lambda p, c: p.write("h", 0),
        PoolMisuseError,
        ("holds the 8 tokens of its prefix hit", "max_tokens=len(prompt) - 1"),
    ),
    (
        "write(0) with no hit",
        lambda p: _written(p, "a", 3),
        lambda p, c: p.write("a", 0),
        PoolMisuseError,
        ("write('a', 0): a step writes at least one token", "call write() only"),
    ),
    (
        "write(0) after a hit looked up but not taken",
        lambda p: _computed_whole_prompt_then_looked_up(p),
        lambda p, c: p.write("r", 0),
        PoolMisuseError,
        ("call write() only",),
    ),
    (
        "allocate fewer tokens than held",
        lambda p: _written(p, "a", 5),
        lambda p, c: p.allocate("a", 1),
        PoolMisuseError,
        (
            "num_tokens=1 is below the 5 tokens request 'a' holds",
            "total token count",
            "pass 6 for one more token",
        ),
    ),
    (
        "can_allocate fewer tokens than held",
        lambda p: _written(p, "a", 5),
        lambda p, c: p.can_allocate("a", 4),
        PoolMisuseError,
        ("num_tokens=4 is below the 5 tokens", "total token count", "pass 6"),
    ),
    (
        "write past the allocation",
        lambda p: _written(p, "a", 8),
        lambda p, c: p.write("a", 1),
        NotAllocatedError,
        ("holds 2 blocks (8 tokens)", "up to token 9", "allocate('a', 9) first", "total"),
    ),
    (
        "allocate below the prefix hit",
        _whole_prompt_hit,
        lambda p, hit: p.allocate("r", 4, hit=hit),
        PoolMisuseError,
        ("below the prefix hit's 16", "total token count (hit included)"),
    ),
    (
        "a hit of another request",
        _another_requests_hit,
        lambda p, hit: p.allocate("other", 16, hit=hit),
        PoolMisuseError,
        ("belongs to request 'r'", "pass the hit lookup('other') returned"),
    ),
    (
        "a hit that is not a PrefixHit",
        lambda p: p.add_request("a", [1]),
        lambda p, c: p.allocate("a", 1, hit="hit"),
        PoolMisuseError,
        ("PrefixHit lookup() returned", "'hit' (str)"),
    ),
    (
        "a hit on a request holding blocks",
        _hit_after_blocks,
        lambda p, hit: p.allocate("a", 4, hit=hit),
        PoolMisuseError,
        ("already holds blocks", "allocate() without hit="),
    ),
    (
        "free twice",
        _freed,
        lambda p, c: p.free("a"),
        UnknownRequestError,
        ("free('a')", "freed already, or never added", "free() each request once"),
    ),
    (
        "a freed request used again",
        _freed,
        lambda p, c: p.write("a", 1),
        UnknownRequestError,
        ("unknown request 'a'", "never added, or freed already", "add_request() opens one"),
    ),
    (
        "a request id that is not a str",
        lambda p: None,
        lambda p, c: p.write(7, 1),
        PoolMisuseError,
        ("a request id is a str", "7 (int)"),
    ),
    (
        "a validation of an aborted request",
        _aborted,
        lambda p, c: p.validate_step("x"),
        RequestAbortedError,
        ("'x' was aborted", "free() it, or zero_request_tail()"),
    ),
    (
        "a rollback past the start",
        lambda p: _written(p, "a", 3),
        lambda p, c: p.zero_request_tail("a", 4),
        PoolMisuseError,
        ("written only 3", "pass at most 3, or None"),
    ),
    (
        "an aborted request keeping failed tokens",
        _aborted,
        lambda p, c: p.zero_request_tail("x", 0),
        RollbackError,
        ("cannot be kept", "zero_request_tail('x') rolls it back"),
    ),
    (
        "hashes appended to a request hashing its tokens",
        lambda p: p.add_request("a", [1]),
        lambda p, c: p.append_block_hashes("a", []),
        PoolMisuseError,
        ("added without block_hashes=", "use append_tokens()"),
    ),
    (
        "out of blocks",
        lambda p: p.add_request("a", [1]),
        lambda p, c: p.allocate("a", 1000),
        OutOfBlocksError,
        ("need 250 blocks, only 16", "nothing was allocated", "free or preempt requests"),
    ),
    (
        "a block id outside the pool",
        lambda p: None,
        lambda p, c: p.block_info(16),
        UnknownBlockError,
        ("block id 16 is outside this pool", "0..15"),
    ),
    (
        "a block id of another type",
        lambda p: None,
        lambda p, c: p.block_state("3"),
        UnknownBlockError,
        ("a block id is an int in 0..15", "'3' (str)"),
    ),
    (
        "a bare block id for a list",
        lambda p: None,
        lambda p, c: p.release_blocks(3),
        PoolMisuseError,
        ("block_ids must be a list", "3 (int)", "wrap a single item in a list"),
    ),
    (
        "a block released twice",
        lambda p: p.release_blocks(p.allocate_blocks(1)),
        lambda p, c: p.release_blocks([0]),
        DoubleFreeError,
        ("block 0 has no reference left to release",),
    ),
    (
        "a block named twice in one release",
        lambda p: p.allocate_blocks(1),
        lambda p, c: p.release_blocks([0, 0]),
        ForeignBlockError,
        ("named 2 times", "holds 1 block-level reference", "release each reference"),
    ),
    (
        "a request's block released at block level",
        lambda p: _written(p, "a", 2),
        lambda p, c: p.release_blocks([p.block_table("a")[0]]),
        ForeignBlockError,
        ("held by a request's block table", "free() the request instead"),
    ),
    (
        "a free block written at block level",
        lambda p: None,
        lambda p, c: p.write_blocks([5]),
        ForeignBlockError,
        ("block 5 (FREE) is not held", "take it with allocate_blocks() first"),
    ),
    (
        "a cached block published under another hash",
        lambda p: p.acquire_blocks([_published_block(p)]),
        lambda p, c: p.publish_block(p.block_table("p")[0], b"other" * 4),
        PoolMisuseError,
        ("already published under another hash", "block_hash() names it"),
    ),
    (
        "a store of an unvalidated block",
        lambda p: _written(p, "a", 4),
        lambda p, c: p.begin_store(p.block_table("a")[0]),
        NotStorableError,
        ("is WRITTEN", "storable_blocks() lists"),
    ),
    (
        "an acknowledgement of no ticket",
        lambda p: None,
        lambda p, c: p.ack_store("ticket"),
        UnknownTicketError,
        ("StoreTicket begin_store() returned", "'ticket' (str)"),
    ),
    (
        "an acknowledgement of a settled ticket",
        _settled_ticket,
        lambda p, ticket: p.ack_store(ticket),
        UnknownTicketError,
        ("not in flight", "settle each ticket once"),
    ),
    (
        "a cached block kept held by a reset",
        lambda p: p.acquire_blocks([_published_block(p)]),
        lambda p, c: p.reset_prefix_cache(keep_held=p.block_table("p")),
        PoolMisuseError,
        ("keep_held names a cached", "release it first"),
    ),
    (
        "a flag that is not a bool",
        lambda p: None,
        lambda p, c: p.allocate_blocks(1, write=1),
        PoolMisuseError,
        ("write must be True or False", "1 (int)"),
    ),
    (
        "a tier name that is not a str",
        lambda p: _published_block(p),
        lambda p, c: p.begin_store(p.block_table("p")[0], 3),
        PoolMisuseError,
        ("a tier name is a str", "3 (int)"),
    ),
    (
        "a hash that is not bytes",
        lambda p: None,
        lambda p, c: p.cached_block_id("h"),
        PoolMisuseError,
        ("block_hash must be a block hash (bytes)", "'h' (str)"),
    ),
    (
        "publications on a pool without caching",
        lambda p: None,
        lambda p, c: p.validate_blocks([], publish={0: (b"h", None, "")}),
        PoolMisuseError,
        ("needs a pool with enable_caching=True", "leave publish out"),
    ),
    (
        "a block published on a pool without caching",
        lambda p: p.allocate_blocks(1),
        lambda p, ids: p.publish_block(ids[0], b"h" * 16),
        PoolMisuseError,
        ("needs a pool with enable_caching=True", "never publishes"),
    ),
]
# Messages about a pool without a prefix cache.
WITHOUT_CACHING = {
    "publications on a pool without caching",
    "a block published on a pool without caching",
}


@pytest.mark.parametrize("name", [m[0] for m in MESSAGES])
def test_each_message_says_what_is_wrong_and_what_to_do(name: str) -> None:
    (setup, call, error, says) = next(m[1:] for m in MESSAGES if m[0] == name)
    pool = make_pool(16, 4, enable_caching=name not in WITHOUT_CACHING)
    context = setup(pool)
    pool.take_events()
    before, stats = pool.snapshot(), pool.stats()
    with pytest.raises(error) as info:
        call(pool, context)
    message = str(info.value)
    for part in says:
        assert part in message, f"{part!r} not in {message!r}"
    assert pool.snapshot() == before
    assert pool.stats() == stats
    pool.check_invariants()


def test_unknown_request_stays_a_key_error_with_a_readable_message() -> None:
    pool = make_pool()
    with pytest.raises(KeyError) as info:
        pool.free("gone")
    assert str(info.value).startswith("free('gone')")
    assert info.value.request_id == "gone"  # type: ignore[attr-defined]
