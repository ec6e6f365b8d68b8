"""Bad input: a clear, typed error, and the pool exactly as it was (snapshot equality)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from kvguard import (
    BlockHash,
    BlockPool,
    DoubleFreeError,
    DuplicateRequestError,
    ForeignBlockError,
    IllegalTransitionError,
    KvGuardError,
    NoPendingStepError,
    NotAllocatedError,
    NotStorableError,
    OutOfBlocksError,
    PoolMisuseError,
    PrefixHit,
    RequestAbortedError,
    RollbackError,
    StaleHitError,
    StoreTicket,
    UnknownBlockError,
    UnknownRequestError,
    UnknownTicketError,
    ZeroPolicy,
)

from .conftest import make_pool
from .helpers import prefill

PROMPT = list(range(16))


class World:
    """A pool with something in every interesting state, and handles to it."""

    def __init__(self) -> None:
        self.pool = pool = make_pool(16, 4)
        prefill(pool, "published", PROMPT)  # 4 PUBLISHED blocks, ref 1
        pool.validate_step("published")
        pool.add_request("pending", list(range(50, 60)))
        pool.allocate("pending", 10)
        pool.write("pending", 6)  # WRITTEN, step in flight
        pool.add_request("aborted", list(range(70, 78)))
        pool.allocate("aborted", 8)
        pool.write("aborted", 8)
        pool.fail_step("aborted")  # QUARANTINED, request aborted
        pool.add_request("fresh", list(range(90, 94)))
        pool.add_request("twin", PROMPT)
        self.twin_hit = pool.lookup("twin")
        assert self.twin_hit.num_tokens == 16
        self.external = pool.allocate_blocks(1)
        self.ticket = pool.begin_store(pool.block_table("published")[0], "cpu")
        self.stale_hit = PrefixHit("fresh", (pool.block_table("published")[0],), (999,), 4)
        pool.take_events()


def cases(w: World) -> list[tuple[str, Callable[[], Any], type[KvGuardError]]]:
    p = w.pool
    published = p.block_table("published")
    pending = p.block_table("pending")
    return [
        ("unknown request: write", lambda: p.write("nope", 1), UnknownRequestError),
        ("unknown request: validate", lambda: p.validate_step("nope"), UnknownRequestError),
        ("unknown request: fail", lambda: p.fail_step("nope"), UnknownRequestError),
        ("unknown request: free", lambda: p.free("nope"), UnknownRequestError),
        ("unknown request: lookup", lambda: p.lookup("nope"), UnknownRequestError),
        ("unknown request: allocate", lambda: p.allocate("nope", 4), UnknownRequestError),
        ("unknown request: rollback", lambda: p.zero_request_tail("nope"), UnknownRequestError),
        ("unknown request: tokens", lambda: p.append_tokens("nope", [1]), UnknownRequestError),
        ("unknown request: table", lambda: p.block_table("nope"), UnknownRequestError),
        ("duplicate request", lambda: p.add_request("fresh"), DuplicateRequestError),
        ("non-int token ids", lambda: p.add_request("x", ["a"]), PoolMisuseError),  # type: ignore[list-item]
        ("token id past int64", lambda: p.add_request("x", [2**63]), PoolMisuseError),
        ("append non-int tokens", lambda: p.append_tokens("pending", [1.5]), PoolMisuseError),  # type: ignore[list-item]
        ("non-str request id", lambda: p.add_request(7), PoolMisuseError),  # type: ignore[arg-type]
        ("bad salt", lambda: p.add_request("x", salt="s"), PoolMisuseError),  # type: ignore[arg-type]
        ("negative allocate", lambda: p.allocate("fresh", -1), PoolMisuseError),
        ("float allocate", lambda: p.allocate("fresh", 1.5), PoolMisuseError),  # type: ignore[arg-type]
        ("bool allocate", lambda: p.allocate("fresh", True), PoolMisuseError),
        ("too many blocks", lambda: p.allocate("fresh", 4 * 100), OutOfBlocksError),
        ("too many raw blocks", lambda: p.allocate_blocks(100), OutOfBlocksError),
        ("negative raw blocks", lambda: p.allocate_blocks(-2), PoolMisuseError),
        ("negative write", lambda: p.write("pending", -1), PoolMisuseError),
        ("empty write", lambda: p.write("pending", 0), PoolMisuseError),
        ("write past allocation", lambda: p.write("pending", 7), NotAllocatedError),
        ("write with no blocks", lambda: p.write("fresh", 1), NotAllocatedError),
        ("write aborted request", lambda: p.write("aborted", 1), RequestAbortedError),
        ("allocate aborted request", lambda: p.allocate("aborted", 12), RequestAbortedError),
        ("validate with nothing written", lambda: p.validate_step("fresh"), NoPendingStepError),
        (
            "validate past what was written",
            lambda: p.validate_step("published"),
            NoPendingStepError,
        ),
        ("fail with nothing pending", lambda: p.fail_step("published"), NoPendingStepError),
        ("validate aborted request", lambda: p.validate_step("aborted"), RequestAbortedError),
        (
            "hit of another request",
            lambda: p.allocate("pending", 12, hit=replace(w.stale_hit, request_id="pending")),
            StaleHitError,
        ),
        ("stale hit", lambda: p.allocate("fresh", 4, hit=w.stale_hit), StaleHitError),
        (
            "hit bigger than the allocation",
            lambda: p.allocate("twin", 8, hit=w.twin_hit),
            PoolMisuseError,
        ),
        ("double free (block level)", lambda: p.release_blocks([pending[-1] + 5]), DoubleFreeError),
        ("foreign block release", lambda: p.release_blocks([published[0]]), ForeignBlockError),
        ("release twice in one call", lambda: p.release_blocks(w.external * 2), ForeignBlockError),
        ("out-of-range block release", lambda: p.release_blocks([16]), UnknownBlockError),
        ("negative block id", lambda: p.block_info(-1), UnknownBlockError),
        ("non-int block id", lambda: p.block_info("3"), UnknownBlockError),  # type: ignore[arg-type]
        ("acquire a written block", lambda: p.acquire_blocks([pending[0]]), IllegalTransitionError),
        (
            "acquire partly bad list",
            lambda: p.acquire_blocks([published[0], 99]),
            UnknownBlockError,
        ),
        ("store a written block", lambda: p.begin_store(pending[0]), NotStorableError),
        (
            "store a quarantined block",
            lambda: p.begin_store(p.block_table("aborted")[0]),
            NotStorableError,
        ),
        ("store a free block", lambda: p.begin_store(15), NotStorableError),
        (
            "ack an unknown ticket",
            lambda: p.ack_store(replace(w.ticket, ticket_id=77)),
            UnknownTicketError,
        ),
        (
            "ack a forged ticket",
            lambda: p.ack_store(replace(w.ticket, generation=5)),
            UnknownTicketError,
        ),
        (
            "fail an unknown ticket",
            lambda: p.fail_store(StoreTicket(9, 0, BlockHash(b"x"), 0, "t")),
            UnknownTicketError,
        ),
        ("negative rollback", lambda: p.zero_request_tail("pending", -1), PoolMisuseError),
        ("rollback past the start", lambda: p.zero_request_tail("pending", 7), PoolMisuseError),
        (
            "rollback into shared blocks",
            lambda: p.zero_request_tail("published", 16),
            RollbackError,
        ),
        ("keep failed tokens", lambda: p.zero_request_tail("aborted", 1), RollbackError),
        ("negative lookup cap", lambda: p.lookup("fresh", max_tokens=-1), PoolMisuseError),
        ("hashes on a token request", lambda: p.append_block_hashes("fresh", []), PoolMisuseError),
    ]


CASE_NAMES = [name for name, _, _ in cases(World())]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input_raises_typed_error_and_changes_nothing(name: str) -> None:
    world = World()
    (call, error) = next((c, e) for n, c, e in cases(world) if n == name)
    before = world.pool.snapshot()
    with pytest.raises(error) as info:
        call()
    assert str(info.value), "errors carry a message naming the culprit"
    assert world.pool.snapshot() == before
    world.pool.check_invariants()


def test_misuse_and_corruption_are_different_families() -> None:
    from kvguard import CorruptionError, InvariantViolation

    assert issubclass(InvariantViolation, CorruptionError)
    assert not issubclass(CorruptionError, PoolMisuseError)
    assert not issubclass(PoolMisuseError, CorruptionError)
    assert not issubclass(OutOfBlocksError, PoolMisuseError)


def test_bad_constructor_arguments() -> None:
    for args in ((0, 4), (4, 0), (-1, 4), (4.0, 4), ("4", 4), (None, 4), (True, 4)):
        with pytest.raises(PoolMisuseError):
            BlockPool(*args)
    wrong: list[dict[str, Any]] = [
        {"zero_policy": "all"},
        {"hasher": "blake2b"},  # not callable: refused now, not at the first lookup
        {"enable_caching": 1},
        {"record_events": None},
        {"block_type": dict},
        {"check_invariants": "yes"},
    ]
    for kwargs in wrong:
        with pytest.raises(PoolMisuseError):
            BlockPool(4, 4, **kwargs)
    assert BlockPool(4, 4, zero_policy=ZeroPolicy.ALL).zero_policy is ZeroPolicy.ALL


def test_broken_bookkeeping_is_reported_as_corruption() -> None:
    from kvguard import InvariantViolation

    pool = make_pool(8, 4)
    prefill(pool, "a", PROMPT)
    pool._kernel.blocks[pool.block_table("a")[0]].ref_cnt = 3  # simulate a kvguard bug
    with pytest.raises(InvariantViolation, match="ref_cnt 3"):
        pool.check_invariants()


# ------------------------------------------------------------ every entry point, swept
#
# Each public method, each of its arguments replaced by each value of WRONG while the
# others stay valid: no bare Python error may escape, a typed error leaves the pool as
# it was, and a value of the wrong type is refused (never accepted and misused).
# Run with the compiled fast paths and in pure Python.

WRONG: tuple[object, ...] = (
    None, True, 0, -1, 3, 10**30, 1.5, "x", b"x", (), [], [None], ["a"], [1.5], [-1],
    [10**30], [[1]], {}, {1: 2}, object(),
)  # fmt: skip


def _ids(v: object) -> bool:
    return isinstance(v, (list, tuple)) and all(type(x) is int for x in v)


def _hashes(v: object) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(x, bytes) for x in v)


# What a well-typed value of each kind of argument is (ranges are the method's business:
# a well-typed value may still be refused, with a typed error).
KINDS: dict[str, Callable[[object], bool]] = {
    "request_id": lambda v: isinstance(v, str),
    "count": lambda v: type(v) is int,
    "optional_count": lambda v: v is None or type(v) is int,
    "flag": lambda v: type(v) is bool,
    "tier": lambda v: isinstance(v, str),
    "hash": lambda v: isinstance(v, bytes),
    "optional_hash": lambda v: v is None or isinstance(v, bytes),
    "ids": _ids,
    "hashes": _hashes,
    "optional_hashes": lambda v: v is None or _hashes(v),
    "tokens": lambda v: isinstance(v, (list, tuple)) and all(type(x) is int for x in v),
    "salt": lambda v: v is None or isinstance(v, bytes),
    "retention": lambda v: type(v) is int,
    "owner": lambda v: isinstance(v, str),
    "hit": lambda v: v is None,  # only lookup() makes hits
    "ticket": lambda v: False,  # only begin_store() makes tickets
    "publish": lambda v: v is None or v == {},
    "seals": lambda v: (
        v is None
        or (isinstance(v, dict) and all(type(k) is int and type(x) is int for k, x in v.items()))
    ),
    "tails": lambda v: (
        isinstance(v, dict) and all(type(k) is int and type(x) is int for k, x in v.items())
    ),
}


def entry_points(w: World) -> dict[str, dict[str, tuple[str, object]]]:
    """method -> argument -> (kind, a valid value in ``w``)."""
    p = w.pool
    pub = p.block_table("published")
    h = p.block_hash(pub[0])
    ext = list(w.external)
    return {
        "add_request": {
            "request_id": ("request_id", "new"),
            "token_ids": ("tokens", [1, 2, 3]),
            "salt": ("salt", None),
            "block_hashes": ("optional_hashes", None),
            "retention": ("retention", 0),
        },
        "append_tokens": {"request_id": ("request_id", "pending"), "token_ids": ("tokens", [1])},
        "append_block_hashes": {
            "request_id": ("request_id", "fresh"),
            "block_hashes": ("hashes", []),
        },
        "lookup": {"request_id": ("request_id", "twin"), "max_tokens": ("optional_count", None)},
        "can_allocate": {
            "request_id": ("request_id", "fresh"),
            "num_tokens": ("count", 4),
            "hit": ("hit", None),
        },
        "allocate": {
            "request_id": ("request_id", "fresh"),
            "num_tokens": ("count", 4),
            "hit": ("hit", None),
        },
        "write": {"request_id": ("request_id", "pending"), "num_tokens": ("count", 1)},
        "validate_step": {"request_id": ("request_id", "pending"), "seals": ("seals", None)},
        "fail_step": {"request_id": ("request_id", "pending")},
        "free": {"request_id": ("request_id", "pending")},
        "block_table": {"request_id": ("request_id", "pending")},
        "progress": {"request_id": ("request_id", "pending")},
        "zero_request_tail": {
            "request_id": ("request_id", "pending"),
            "num_tokens": ("optional_count", None),
        },
        "roll_back_blocks": {"tails": ("tails", {ext[0]: 0})},
        "storable_blocks": {"request_id": ("request_id", "published"), "tier": ("tier", "cpu")},
        "allocate_blocks": {"num_blocks": ("count", 1), "write": ("flag", False)},
        "acquire_blocks": {"block_ids": ("ids", [pub[0]])},
        "release_blocks": {"block_ids": ("ids", ext), "steps_passed": ("flag", False)},
        "write_blocks": {"block_ids": ("ids", ext)},
        "validate_blocks": {
            "block_ids": ("ids", ext),
            "publish": ("publish", None),
            "seals": ("seals", None),
        },
        "fail_blocks": {"block_ids": ("ids", ext)},
        "publish_block": {
            "block_id": ("count", ext[0]),
            "block_hash": ("hash", b"h" * 16),
            "parent_hash": ("optional_hash", None),
            "owner": ("owner", ""),
        },
        "disown_reference": {"block_id": ("count", ext[0])},
        "begin_store": {"block_id": ("count", pub[0]), "tier": ("tier", "cpu")},
        "ack_store": {"ticket": ("ticket", w.ticket)},
        "fail_store": {"ticket": ("ticket", w.ticket)},
        "forget_tier_copy": {"tier": ("tier", "cpu"), "block_hash": ("hash", h)},
        "tier_copies": {"block_hash": ("hash", h)},
        "tier_seal": {"block_hash": ("hash", h), "tier": ("tier", "cpu")},
        "block_seal": {"block_id": ("count", 0)},
        "invalidate": {"block_hashes": ("hashes", [h]), "descendants": ("flag", True)},
        "reset_prefix_cache": {"keep_held": ("ids", ())},
        "block_info": {"block_id": ("count", 0)},
        "block_state": {"block_id": ("count", 0)},
        "block_hash": {"block_id": ("count", 0)},
        "cached_block_id": {"block_hash": ("hash", h)},
        "free_block_ids": {"after": ("optional_count", None)},
    }


NO_ARGUMENTS = {
    "check_invariants",
    "counters",
    "get_num_free_blocks",
    "snapshot",
    "stats",
    "take_blocks_to_zero",
    "take_events",
    "take_slots_to_zero",
}


def test_the_sweep_covers_every_public_method_and_argument() -> None:
    import inspect

    table = entry_points(World())
    for name, member in inspect.getmembers(BlockPool):
        if name.startswith("_") or not inspect.isfunction(member):
            continue
        params = [p for p in inspect.signature(member).parameters if p != "self"]
        if name in NO_ARGUMENTS:
            assert not params, name
            continue
        assert name in table, f"BlockPool.{name} is not in the bad-input sweep"
        assert sorted(table[name]) == sorted(params), name


@pytest.mark.parametrize("compiled", [True, False], ids=["C", "python"])
@pytest.mark.parametrize("method", sorted(entry_points(World())))
def test_every_argument_refuses_wrong_values(
    method: str, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvguard.fast_path import PURE_PYTHON_ENV, available

    if compiled:
        monkeypatch.delenv(PURE_PYTHON_ENV, raising=False)
        if not available():
            pytest.skip("kvguard._speedups is not built")
    else:
        monkeypatch.setenv(PURE_PYTHON_ENV, "1")
    for arg in entry_points(World())[method]:
        for wrong in WRONG:
            world = World()
            assert (world.pool._kernel._fast is not None) is compiled
            valid = {a: v for a, (_, v) in entry_points(world)[method].items()}
            kind = entry_points(world)[method][arg][0]
            valid[arg] = wrong
            before = world.pool.snapshot()
            what = f"{method}({arg}={wrong!r})"
            try:
                getattr(world.pool, method)(**valid)
            except KvGuardError as exc:
                assert str(exc), what
                assert world.pool.snapshot() == before, f"{what} changed the pool"
            except Exception as exc:  # a bare Python error escaped: the bug under test
                raise AssertionError(f"{what} raised {exc!r}") from exc
            else:
                assert KINDS[kind](wrong), f"{what} accepted a value of the wrong type"
            world.pool.check_invariants()
