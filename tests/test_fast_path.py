"""The compiled fast paths (``kvguard._speedups``) against the pure-Python reference.

Every test builds a *pair* of pools: one with the C fast paths (``pool._kernel._fast`` set), one
built with ``KVGUARD_PURE_PYTHON=1`` in the environment (``pool._kernel._fast is None``). Each
operation runs on both, and then:

* both return equal results, or both raise the same error type with the same message;
* everything observable is equal -- every field of every block record, the free queue
  (its tiers in order, its size, its evictable count and retention classes), the prefix
  index in insertion order, ``stats()``, the zero queue, the events and ``snapshot()``;
* both pass ``check_invariants()``;
* a typed error (misuse, or running out of blocks) left both pools as they were.

A stateful property test drives random block-level sequences (allocate with evictions
and quarantined blocks to reuse, acquire, release with and without ``steps_passed``,
write, validate with held publications, publish, fail) mixed with request-level steps
(which set retention classes and hold blocks in block tables), tier stores,
invalidations and cache resets, junk arguments among them, over every zeroing policy,
with and without recorded events, with kvguard's block records and an engine's subclass
of them. A focused property test covers evictions across retention classes; readable
examples pin the cases that matter most.

Without the extension these tests skip. ``KVGUARD_REQUIRE_SPEEDUPS=1`` turns a missing
extension into a failure instead: ``.ci/run`` sets it for a second run of this file,
after the install that builds the extension, so that a silently failed build is caught.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import operator
import os
import types
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from kvguard import (
    BlockPool,
    BlockRemoved,
    BlockState,
    DoubleFreeError,
    ForeignBlockError,
    KvGuardError,
    OutOfBlocksError,
    PoolMisuseError,
    ZeroPolicy,
)
from kvguard.block import Block
from kvguard.fast_path import PURE_PYTHON_ENV
from kvguard.hashing import BlockHash
from kvguard.results import PublishOutcome
from kvguard.states import MATCHABLE_STATES

REQUIRE_SPEEDUPS_ENV = "KVGUARD_REQUIRE_SPEEDUPS"


def _speedups_import_error() -> str | None:
    """Why ``kvguard._speedups`` cannot be imported, or None when it can."""
    try:
        importlib.import_module("kvguard._speedups")
    except ImportError as exc:
        return str(exc)
    return None


SPEEDUPS_MISSING = _speedups_import_error()
requires_speedups = pytest.mark.skipif(
    SPEEDUPS_MISSING is not None,
    reason=f"kvguard._speedups is not built ({SPEEDUPS_MISSING})",
)

S = BlockState
BLOCK_SIZE = 4
HASHES = [BlockHash(bytes([i]) * 8) for i in range(6)]
H0, H1, H2, H3, H4, H5 = HASHES
REQUEST_IDS = ["r0", "r1", "r2"]
# Every field of a block record (new fields are compared too); these at least.
BLOCK_FIELDS = tuple(field.name for field in dataclasses.fields(Block))
assert set(BLOCK_FIELDS) >= {
    "block_id",
    "state",
    "ref_cnt",
    "block_hash",
    "parent_hash",
    "generation",
    "external_refs",
}


@dataclasses.dataclass(slots=True, eq=False)
class TaggedBlock(Block):
    """An engine's block record: kvguard's fields plus its own (the vLLM adapter's are)."""

    tag: int = 0


def test_speedups_importable_when_required(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not skipped where CI sets KVGUARD_REQUIRE_SPEEDUPS=1: the build must have worked."""
    if os.environ.get(REQUIRE_SPEEDUPS_ENV, "") in ("", "0"):
        pytest.skip(f"set {REQUIRE_SPEEDUPS_ENV}=1 to require the compiled fast paths")
    assert SPEEDUPS_MISSING is None, f"kvguard._speedups does not import: {SPEEDUPS_MISSING}"
    monkeypatch.delenv(PURE_PYTHON_ENV, raising=False)
    assert BlockPool(4, BLOCK_SIZE)._kernel.compiled, "a pool built now has no fast paths"


# -- the pair, and what is compared ---------------------------------------------------


def observe(pool: BlockPool) -> dict[str, object]:
    """Everything observable about ``pool``, by name (equal dicts: equal pools)."""
    free = pool._kernel.free
    first = free.first
    return {
        "blocks": [
            tuple(getattr(block, name) for name in BLOCK_FIELDS) for block in pool._kernel.blocks
        ],
        "free_queue": free.snapshot(),
        "free_queue.size": free.size,
        "free_queue.num_evictable": free.num_evictable,
        "free_queue.classes": [(r, list(bucket)) for r, bucket in free.evictable.items()],
        "free_queue.first_class": None if first is None else first[0],
        "index": list(pool._kernel.index.items()),  # insertion order too
        "writers": sorted(pool._kernel.writers.items()),
        "deferred": sorted(pool._kernel.deferred.items()),
        "retention": sorted(pool._kernel.retention.items()),
        "stats": pool.stats(),
        "zero_queue": pool._kernel.zero.pending_blocks(),
        "events": list(pool._kernel.events),
        "snapshot": pool.snapshot(),
        "tainted": sorted(pool._kernel.tainted),
    }


def _diff(
    one: dict[str, Any], other: dict[str, Any], names: tuple[str, str] = ("C", "Python")
) -> str:
    """What differs between two :func:`observe` results, block by block for blocks."""
    a, b = names
    lines: list[str] = []
    for key, value in one.items():
        if value == other[key] or (key == "snapshot" and lines):  # (snapshot: a summary)
            continue
        if key != "blocks":
            lines.append(f"  {key}:\n    {a}: {value!r}\n    {b}: {other[key]!r}")
            continue
        for one_row, other_row in zip(value, other[key], strict=True):
            fields = [
                f"{name} {a} {x!r} {b} {y!r}"
                for name, x, y in zip(BLOCK_FIELDS, one_row, other_row, strict=True)
                if x != y
            ]
            if fields:
                lines.append(f"  block {one_row[0]}: " + ", ".join(fields))
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Raised:
    """An operation's error, compared by type and message."""

    type: type[BaseException]
    message: str


@dataclasses.dataclass
class Pair:
    fast: BlockPool
    pure: BlockPool
    log: list[str] = dataclasses.field(default_factory=list)

    def run(self, what: str, op: Callable[[BlockPool], object], *, atomic: bool = True) -> object:
        """Run ``op`` on both pools and check they agree (see the module docstring).

        ``atomic``: ``op`` is one pool call, so a typed error must have changed nothing
        (a sequence of calls may stop after some of them changed the pool).
        """
        self.log.append(what)
        before = observe(self.pure)
        outcomes = []
        for pool in (self.fast, self.pure):
            try:
                outcomes.append(op(pool))
            except Exception as exc:
                outcomes.append(Raised(type(exc), str(exc)))
        steps = "\n  ".join(self.log)
        fast_out, pure_out = outcomes
        for out in outcomes:
            if isinstance(out, Raised) and not issubclass(out.type, KvGuardError):
                pytest.fail(f"{what} raised a bare {out.type.__name__}: {out}\nsteps:\n  {steps}")
        assert fast_out == pure_out, (
            f"{what}: C returned {fast_out!r}, Python {pure_out!r}\nsteps:\n  {steps}"
        )
        fast, pure = observe(self.fast), observe(self.pure)
        if fast != pure:
            pytest.fail(
                f"{what} left the C and Python pools different:\n{_diff(fast, pure)}\n"
                f"steps:\n  {steps}"
            )
        self.fast.check_invariants()
        self.pure.check_invariants()
        typed_error = isinstance(pure_out, Raised) and issubclass(pure_out.type, KvGuardError)
        if atomic and typed_error and pure != before:
            pytest.fail(
                f"{what} raised {pure_out} but changed the pool:\n"
                f"{_diff(pure, before, ('after', 'before'))}\nsteps:\n  {steps}"
            )
        return pure_out

    def call(self, method: str, *args: Any, **kwargs: Any) -> object:
        """:meth:`run` for ``pool.<method>(*args, **kwargs)`` (the same arguments to
        both pools, which must leave them as they were)."""
        shown = ", ".join([repr(arg) for arg in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
        result = self.run(f"{method}({shown})", operator.methodcaller(method, *args, **kwargs))
        again = ", ".join([repr(arg) for arg in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
        assert again == shown, f"{method}() changed its arguments: ({shown}) -> ({again})"
        return result

    def ok(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """:meth:`call` for a call that must succeed; its result."""
        result = self.call(method, *args, **kwargs)
        assert not isinstance(result, Raised), f"{method}{args} raised {result}"
        return result

    # What the next operation may name, read off the (equal) pools.

    def ids_where(self, pred: Callable[[Block], bool]) -> list[int]:
        return [block.block_id for block in self.pure._kernel.blocks if pred(block)]

    def held(self) -> list[int]:
        """One entry per block-level reference."""
        return [
            block.block_id for block in self.pure._kernel.blocks for _ in range(block.external_refs)
        ]


def make_pair(
    mp: pytest.MonkeyPatch,
    num_blocks: int,
    *,
    zero_policy: ZeroPolicy = ZeroPolicy.SUSPECT,
    record_events: bool = True,
    block_type: type[Block] = Block,
) -> Pair:
    """A C-path pool and a pure-Python one (the environment is read when a pool is built)."""

    def build() -> BlockPool:
        return BlockPool(
            num_blocks,
            BLOCK_SIZE,
            enable_caching=True,
            zero_policy=zero_policy,
            record_events=record_events,
            block_type=block_type,
            check_invariants=False,  # checked after every operation, on both pools
        )

    mp.delenv(PURE_PYTHON_ENV, raising=False)
    fast = build()
    mp.setenv(PURE_PYTHON_ENV, "1")
    pure = build()
    mp.delenv(PURE_PYTHON_ENV)
    assert fast._kernel._fast is not None, "the C pool has no fast paths"
    assert pure._kernel._fast is None, f"{PURE_PYTHON_ENV}=1 did not make a pure-Python pool"
    return Pair(fast, pure)


@pytest.fixture
def pair_of(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Pair]:
    def build(num_blocks: int = 8, **kwargs: Any) -> Pair:
        return make_pair(monkeypatch, num_blocks, **kwargs)

    return build


# -- the stateful property test -------------------------------------------------------


def _junk_ids(num_blocks: int) -> list[Any]:
    """Ids no call accepts: outside the pool, or not ints."""
    return [-1, num_blocks, 2**70, "1", True, 1.0]


class FastPathMachine(RuleBasedStateMachine):
    """Random operation sequences on a C/Python pair; :meth:`Pair.run` checks each."""

    pair: Pair

    @initialize(
        num_blocks=st.one_of(st.integers(4, 8), st.integers(4, 24)),
        # (ALL leaves every allocation to the Python path: drawn less often.)
        zero_policy=st.sampled_from(
            [ZeroPolicy.SUSPECT, ZeroPolicy.NONE, ZeroPolicy.SUSPECT, ZeroPolicy.ALL]
        ),
        record_events=st.booleans(),
        block_type=st.sampled_from([Block, TaggedBlock]),
    )
    def build(
        self,
        num_blocks: int,
        zero_policy: ZeroPolicy,
        record_events: bool,
        block_type: type[Block],
    ) -> None:
        with pytest.MonkeyPatch.context() as mp:
            self.pair = make_pair(
                mp,
                num_blocks,
                zero_policy=zero_policy,
                record_events=record_events,
                block_type=block_type,
            )
        self.pair.log.append(
            f"BlockPool({num_blocks}, {zero_policy}, {record_events=}, {block_type.__name__})"
        )

    def _draw_ids(
        self, data: st.DataObject, likely: list[int], *, max_size: int = 4, junk: bool = True
    ) -> list[Any]:
        """Ids from ``likely`` (the ones the call expects) most of the time; otherwise
        a mix of those, any block's and junk ones. Repeats allowed."""
        mixed = data.draw(st.integers(0, 3)) == 0
        if likely and not mixed:
            return data.draw(st.lists(st.sampled_from(likely), max_size=max_size))
        num_blocks = self.pair.pure.num_blocks
        options: list[st.SearchStrategy[Any]] = [st.integers(0, num_blocks - 1)]
        if likely:
            options = [st.sampled_from(likely)] * 2 + options
        if junk:
            options.append(st.sampled_from(_junk_ids(num_blocks)))
        return data.draw(st.lists(st.one_of(options), max_size=max_size))

    def _draw_id(self, data: st.DataObject, likely: list[int], *, junk: bool = True) -> Any:
        return (self._draw_ids(data, likely, max_size=1, junk=junk) or [0])[0]

    @rule(
        n=st.one_of(
            st.integers(0, 3),
            st.integers(0, 3),
            st.integers(0, 26),
            st.sampled_from([-1, "2", True, 2**70]),
        ),
        write=st.booleans(),
    )
    def allocate_blocks(self, n: Any, write: bool) -> None:
        self.pair.call("allocate_blocks", n, write=write)

    @precondition(lambda self: self.pair.pure._kernel.free.num_evictable)
    @rule(extra=st.integers(1, 3), write=st.booleans())
    def allocate_past_free(self, extra: int, write: bool) -> None:
        """More blocks than the FREE ones: cached ones are evicted (or, short of them,
        OutOfBlocksError)."""
        self.pair.call(
            "allocate_blocks", len(self.pair.pure._kernel.free.empty) + extra, write=write
        )

    @rule(
        data=st.data(),
        n=st.integers(1, 4),
        parent=st.one_of(st.none(), st.sampled_from(HASHES)),
    )
    def publish_fresh(self, data: st.DataObject, n: int, parent: BlockHash | None) -> None:
        """Blocks allocated WRITTEN, then validated with held publications (some hashes
        collide): a quick way to cached blocks."""
        ids = self.pair.call("allocate_blocks", n, write=True)
        if isinstance(ids, Raised):
            return
        assert isinstance(ids, list)
        hashes = data.draw(st.lists(st.sampled_from(HASHES), min_size=n, max_size=n))
        publish = {i: (h, parent, "f") for i, h in zip(ids, hashes, strict=True)}
        self.pair.call("validate_blocks", ids, publish)

    @rule(data=st.data(), as_tuple=st.booleans())
    def acquire_blocks(self, data: st.DataObject, as_tuple: bool) -> None:
        cached = self.pair.ids_where(lambda b: b.state in MATCHABLE_STATES)
        ids = self._draw_ids(data, cached)
        self.pair.call("acquire_blocks", tuple(ids) if as_tuple else ids)

    @rule(data=st.data(), steps_passed=st.booleans())
    def release_blocks(self, data: st.DataObject, steps_passed: bool) -> None:
        ids = self._draw_ids(data, self.pair.held(), max_size=5)
        self.pair.call("release_blocks", ids, steps_passed=steps_passed)

    @precondition(lambda self: self.pair.held())
    @rule(data=st.data(), steps_passed=st.booleans())
    def release_held(self, data: st.DataObject, steps_passed: bool) -> None:
        """Every block-level reference, in any order (a holder finishing)."""
        ids = data.draw(st.permutations(self.pair.held()))
        self.pair.call("release_blocks", ids, steps_passed=steps_passed)

    @rule(data=st.data())
    def write_blocks(self, data: st.DataObject) -> None:
        self.pair.call("write_blocks", self._draw_ids(data, self.pair.held(), max_size=3))

    @rule(data=st.data(), kind=st.sampled_from(["none", "empty", "dict", "proxy"]))
    def validate_blocks(self, data: st.DataObject, kind: str) -> None:
        written = self.pair.ids_where(lambda b: b.state is S.WRITTEN)
        ids = self._draw_ids(data, written)
        publish: Any = None
        if kind != "none":
            # Held publications for some of the ids, maybe for others; some collide
            # with indexed hashes or with each other.
            named = [i for i in ids if type(i) is int] + [data.draw(st.integers(0, 23))]
            held: dict[int, Any] = {}
            for block_id in data.draw(st.lists(st.sampled_from(named), max_size=4)):
                held[block_id] = data.draw(
                    st.one_of(
                        st.tuples(
                            st.sampled_from(HASHES),
                            st.one_of(st.none(), st.sampled_from(HASHES)),
                            st.sampled_from(["a", "b"]),
                        ),
                        st.none(),  # publish.get() gives None: no held publication
                    )
                )
            publish = types.MappingProxyType(held) if kind == "proxy" else held
        self.pair.call("validate_blocks", ids, publish)

    @rule(
        data=st.data(),
        block_hash=st.sampled_from(HASHES),
        parent=st.one_of(st.none(), st.sampled_from(HASHES)),
    )
    def publish_block(
        self, data: st.DataObject, block_hash: BlockHash, parent: BlockHash | None
    ) -> None:
        block_id = self._draw_id(data, self.pair.held())
        self.pair.call("publish_block", block_id, block_hash, parent, owner="p")

    @rule(data=st.data())
    def fail_blocks(self, data: st.DataObject) -> None:
        written = self.pair.ids_where(lambda b: b.state is S.WRITTEN)
        self.pair.call("fail_blocks", self._draw_ids(data, written, max_size=3))

    @rule(
        data=st.data(),
        request_id=st.sampled_from(REQUEST_IDS),
        retention=st.integers(0, 2),
        num_blocks=st.integers(1, 3),
        passed=st.booleans(),
    )
    def request_step(
        self,
        data: st.DataObject,
        request_id: str,
        retention: int,
        num_blocks: int,
        passed: bool,
    ) -> None:
        """A request admitted with a prefix hit and one step: its blocks are held by a
        block table (not block-level), and its cached ones carry its retention class."""
        # Distinct, as chained hashes are (a repeated hash would make the prefix hit
        # name one block twice).
        hashes = data.draw(
            st.lists(st.sampled_from(HASHES), min_size=num_blocks, max_size=3, unique=True)
        )
        num_tokens = num_blocks * BLOCK_SIZE

        def step(pool: BlockPool) -> object:
            pool.add_request(request_id, block_hashes=hashes, retention=retention)
            hit = pool.lookup(request_id, max_tokens=num_tokens - 1)
            new = pool.allocate(request_id, num_tokens, hit=hit)
            pool.write(request_id, num_tokens - hit.num_tokens)
            result = pool.validate_step(request_id) if passed else pool.fail_step(request_id)
            return hit, new, result

        self.pair.run(
            f"request_step({request_id!r}, {hashes!r}, {retention=}, {num_blocks=}, {passed=})",
            step,
            atomic=False,
        )

    @rule(request_id=st.sampled_from(REQUEST_IDS))
    def free_request(self, request_id: str) -> None:
        self.pair.call("free", request_id)

    @rule(
        request_id=st.sampled_from(REQUEST_IDS),
        num_tokens=st.integers(1, 2 * BLOCK_SIZE),
        passed=st.booleans(),
    )
    def request_continues(self, request_id: str, num_tokens: int, passed: bool) -> None:
        """An open request's next step, in whatever order the rules left it (aborted by a
        failed step or an invalidation, freed, rolled back): typed errors, or a step."""

        def step(pool: BlockPool) -> object:
            progress = pool.progress(request_id)
            pool.allocate(request_id, progress.num_written_tokens + num_tokens)
            pool.write(request_id, num_tokens)
            return pool.validate_step(request_id) if passed else pool.fail_step(request_id)

        self.pair.run(
            f"request_continues({request_id!r}, {num_tokens}, {passed=})", step, atomic=False
        )

    @rule(
        request_id=st.sampled_from(REQUEST_IDS),
        num_tokens=st.one_of(st.none(), st.integers(0, 2 * BLOCK_SIZE)),
    )
    def zero_request_tail(self, request_id: str, num_tokens: int | None) -> None:
        self.pair.call("zero_request_tail", request_id, num_tokens)

    @rule(data=st.data(), reopen=st.booleans())
    def stale_hit(self, data: st.DataObject, reopen: bool) -> None:
        """A hit used after its request was freed and reopened under the same id, or by
        a request that already holds blocks: refused, nothing changed."""
        request_id = data.draw(st.sampled_from(REQUEST_IDS))
        hashes = data.draw(st.lists(st.sampled_from(HASHES), min_size=1, max_size=3, unique=True))

        def use(pool: BlockPool) -> object:
            if request_id not in pool.request_ids:
                pool.add_request(request_id, block_hashes=hashes)
            hit = pool.lookup(request_id)
            if reopen:
                pool.free(request_id)
                pool.add_request(request_id, block_hashes=hashes[::-1])
            return pool.allocate(request_id, len(hashes) * BLOCK_SIZE, hit=hit)

        self.pair.run(f"stale_hit({request_id!r}, {hashes!r}, {reopen=})", use, atomic=False)

    @rule(
        data=st.data(),
        method=st.sampled_from(["publish_block", "fail_blocks", "validate_blocks", "write_blocks"]),
    )
    def block_level_on_request_blocks(self, data: st.DataObject, method: str) -> None:
        """Block-level calls naming blocks that request block tables hold."""
        held = self.pair.ids_where(lambda b: b.ref_cnt > b.external_refs)
        block_id = self._draw_id(data, held)
        if method == "publish_block":
            self.pair.call(method, block_id, HASHES[0], None, owner="x")
        else:
            self.pair.call(method, [block_id])

    @rule(
        method=st.sampled_from(
            ["validate_blocks", "release_blocks", "acquire_blocks", "fail_blocks",
             "write_blocks", "invalidate", "lookup", "free", "allocate_blocks", "ack_store",
             "begin_store", "reset_prefix_cache", "append_block_hashes"]
        ),
        junk=st.sampled_from([None, 7, "ab", b"ab", [None], [[1]], {1: (b"h", 2, 3)}, 1.5]),
    )  # fmt: skip
    def junk_argument(self, method: str, junk: object) -> None:
        """A wrong type where a call expects ids, hashes, a ticket or a request id."""
        if method == "reset_prefix_cache":
            self.pair.call(method, keep_held=junk)
        elif method == "validate_blocks":
            self.pair.call(method, self.pair.held()[:1], junk)
        elif method == "append_block_hashes":
            self.pair.call(method, REQUEST_IDS[0], junk)
        else:
            self.pair.call(method, junk)

    @rule(data=st.data())
    def offload(self, data: st.DataObject) -> None:
        """A tier stores a block: PUBLISHED becomes OFFLOADED (matchable still)."""
        block_id = self._draw_id(data, self.pair.ids_where(lambda b: b.state is S.PUBLISHED))

        def store(pool: BlockPool) -> object:
            ticket = pool.begin_store(block_id)
            return ticket, pool.ack_store(ticket)

        self.pair.run(f"offload({block_id!r})", store, atomic=False)

    @rule(hashes=st.lists(st.sampled_from(HASHES), max_size=2), descendants=st.booleans())
    def invalidate(self, hashes: list[BlockHash], descendants: bool) -> None:
        self.pair.call("invalidate", hashes, descendants=descendants)

    @precondition(lambda self: not any(b.ref_cnt for b in self.pair.pure._kernel.blocks))
    @rule()
    def reset_prefix_cache(self) -> None:
        self.pair.call("reset_prefix_cache")

    @rule()
    def drain(self) -> None:
        self.pair.call("take_events")
        self.pair.call("take_blocks_to_zero")


FastPathMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVGUARD_STATEFUL_EXAMPLES", "300")),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestFastPathMachine = requires_speedups(FastPathMachine.TestCase)


@requires_speedups
@settings(max_examples=100, deadline=None)
@given(
    retentions=st.lists(st.integers(0, 2), min_size=1, max_size=6),
    data=st.data(),
    record_events=st.booleans(),
)
def test_evictions_across_retention_classes(
    retentions: list[int], data: st.DataObject, record_events: bool
) -> None:
    """Cached blocks in several retention classes, re-released in a random order by
    block-level holders (a release keeps a block's class), then allocations reaching
    into them, one batch at a time."""
    with pytest.MonkeyPatch.context() as mp:
        pair = make_pair(mp, len(retentions) + 2, record_events=record_events)
    for i, retention in enumerate(retentions):

        def cache(pool: BlockPool, i: int = i, retention: int = retention) -> None:
            pool.add_request(f"q{i}", block_hashes=[HASHES[i]], retention=retention)
            pool.allocate(f"q{i}", BLOCK_SIZE)
            pool.write(f"q{i}", BLOCK_SIZE)
            pool.validate_step(f"q{i}")
            pool.free(f"q{i}")

        pair.run(f"cache {HASHES[i]!r} in class {retention}", cache, atomic=False)
    cached = list(pair.pure.prefix_index.values())
    hits = data.draw(st.lists(st.sampled_from(cached), unique=True))
    pair.ok("acquire_blocks", hits)
    pair.ok("release_blocks", data.draw(st.permutations(hits)))
    while pair.pure._kernel.free.size:
        n = data.draw(st.integers(1, pair.pure._kernel.free.size))
        pair.ok("allocate_blocks", n, write=data.draw(st.booleans()))


# -- readable examples ----------------------------------------------------------------


def _published(pair: Pair, hashes: list[BlockHash]) -> list[int]:
    """One block per hash, allocated WRITTEN and validated PUBLISHED; still held."""
    ids: list[int] = pair.ok("allocate_blocks", len(hashes), write=True)
    publish = {block_id: (h, None, "o") for block_id, h in zip(ids, hashes, strict=True)}
    result = pair.ok("validate_blocks", ids, publish)
    assert result.published == tuple(ids)
    return ids


def _blocks(pool: BlockPool, *ids: int) -> list[Block]:
    return [pool._kernel.blocks[i] for i in ids]


def _both(pair: Pair) -> tuple[BlockPool, BlockPool]:
    return pair.fast, pair.pure


@requires_speedups
@pytest.mark.parametrize("record_events", [True, False])
def test_eviction_order_across_cached_blocks(
    pair_of: Callable[..., Pair], record_events: bool
) -> None:
    """Allocating more than the FREE blocks: FREE ones first, then cached ones -- the
    lowest retention class first, least recently released first within it."""
    pair = pair_of(8, record_events=record_events)
    a, b, c, d = _published(pair, [H0, H1, H2, H3])

    def cached_by_request(pool: BlockPool) -> None:
        """A request's block, cached in retention class 1 when the request is freed."""
        pool.add_request("r0", block_hashes=[H4], retention=1)
        pool.allocate("r0", BLOCK_SIZE)
        pool.write("r0", BLOCK_SIZE)
        pool.validate_step("r0")
        pool.free("r0")

    pair.run("request r0, retention 1", cached_by_request, atomic=False)
    r = pair.pure.prefix_index[H4]
    pair.ok("acquire_blocks", [r])  # a block-level holder takes it (a prefix hit) ...
    pair.ok("release_blocks", [c, r, a])  # ... and releases it between class-0 blocks
    pair.ok("release_blocks", [d, b])
    quarantined, empty, evictable = pair.pure._kernel.free.snapshot()
    assert (quarantined, len(empty), evictable) == ((), 3, (c, a, d, b, r))
    pair.ok("take_events")

    ids = pair.ok("allocate_blocks", 6)
    assert ids == list(reversed(empty)) + [c, a, d]
    for pool in _both(pair):
        assert pool._kernel.free.snapshot() == ((), (), (b, r))
        assert dict(pool.prefix_index) == {H1: b, H4: r}
        assert pool.stats().counters.blocks_evicted == 3
        assert [block.state for block in _blocks(pool, *ids)] == [S.ALLOCATED] * 6
        assert [block.block_hash for block in _blocks(pool, c, a, d)] == [None] * 3
        assert pool._kernel.events == (
            [BlockRemoved((H2, H0, H3), (c, a, d))] if record_events else []
        )

    assert pair.ok("allocate_blocks", 2, write=True) == [b, r], "retention 1 goes last"
    result = pair.call("allocate_blocks", 1)
    assert isinstance(result, Raised) and result.type is OutOfBlocksError


@requires_speedups
def test_release_mixing_cached_freed_and_pending_blocks(pair_of: Callable[..., Pair]) -> None:
    """``steps_passed=True`` over a cached block, an ALLOCATED one, a WRITTEN one with
    nothing to publish, one with a deferred publication and one whose deferred
    publication duplicates an indexed hash: the FREE ones join the free queue in release
    order, the published ones the eviction queue."""
    pair = pair_of(10, record_events=False)
    (cached,) = _published(pair, [H0])
    pair.ok("release_blocks", [cached])
    pair.ok("acquire_blocks", [cached])  # a prefix hit: out of the eviction queue again
    (allocated,) = pair.ok("allocate_blocks", 1)
    plain, deferred, duplicate = pair.ok("allocate_blocks", 3, write=True)
    assert pair.ok("publish_block", deferred, H1, owner="o") is PublishOutcome.DEFERRED
    assert pair.ok("publish_block", duplicate, H0, owner="o") is PublishOutcome.DEFERRED
    empty_before = pair.pure._kernel.free.snapshot()[1]

    ids = [cached, allocated, plain, deferred, duplicate]
    pair.ok("release_blocks", ids, steps_passed=True)
    for pool in _both(pair):
        assert pool._kernel.free.snapshot() == (
            (),
            empty_before + (allocated, plain, duplicate),
            (cached, deferred),
        )
        assert dict(pool.prefix_index) == {H0: cached, H1: deferred}
        assert [block.state for block in _blocks(pool, *ids)] == [
            S.PUBLISHED,
            S.FREE,
            S.FREE,
            S.PUBLISHED,
            S.FREE,
        ]
        assert pool.stats().counters.blocks_published == 2


@requires_speedups
@pytest.mark.parametrize("record_events", [True, False])
def test_free_releases_a_table_tail_first_in_c(
    pair_of: Callable[..., Pair], record_events: bool
) -> None:
    """``free`` over blocks another request still holds, published ones, a validated
    partial one and one its pending step still writes, with and without a retention
    class (and a class to forget): the twin does it all, declining nothing, as the
    Python primitive does."""
    from kvguard.transition_kernel import TransitionKernel

    pair = pair_of(16, record_events=record_events)
    kernel = pair.fast._kernel
    declined: list[tuple[list[int], int]] = []

    def release_table(table: list[int], retention: int) -> None:
        declined.append((list(table), retention))
        TransitionKernel.release_table(kernel, table, retention)

    assert kernel._fast is not None
    kernel._fast.fallbacks(  # the same primitives, release_table's recorded
        TransitionKernel.allocate.__get__(kernel),
        TransitionKernel.acquire.__get__(kernel),
        TransitionKernel.release_held.__get__(kernel),
        TransitionKernel.validate_held.__get__(kernel),
        release_table,
        kernel._settle_released,
        kernel._drop_last_refs,
    )
    n = 3 * BLOCK_SIZE + 2
    pair.ok("add_request", "a", block_hashes=[H0, H1, H2], retention=2)
    pair.ok("allocate", "a", n)
    pair.ok("write", "a", n)
    pair.ok("validate_step", "a")
    a0, a1, a2, partial = pair.fast.block_table("a")
    pair.ok("add_request", "b", block_hashes=[H0, H1, H3])
    hit = {pool: pool.lookup("b") for pool in _both(pair)}
    pair.run("allocate b with its hit", lambda pool: pool.allocate("b", n, hit=hit[pool]))
    pair.ok("write", "b", n - 2 * BLOCK_SIZE)  # pending: never validated
    written = pair.fast.block_table("b")[2:]

    pair.ok("free", "a")
    for pool in _both(pair):
        assert [b.ref_cnt for b in _blocks(pool, a0, a1, a2, partial)] == [1, 1, 0, 0]
        assert pool.block_state(partial) is S.FREE
        assert pool._kernel.retention == {a2: 2}
    pair.ok("free", "b")
    for pool in _both(pair):
        assert [pool.block_state(b) for b in written] == [S.QUARANTINED, S.QUARANTINED]
        assert pool._kernel.free.snapshot()[2] == (a1, a0, a2)  # class 0 first
    pair.ok("add_request", "c", block_hashes=[H0, H1, H2])
    hit = {pool: pool.lookup("c") for pool in _both(pair)}
    pair.run("allocate c with its hit", lambda pool: pool.allocate("c", n, hit=hit[pool]))
    pair.ok("free", "c")  # class 0: a2 forgets its class 2
    for pool in _both(pair):
        assert pool._kernel.retention == {}
    assert declined == []


@requires_speedups
@pytest.mark.parametrize("record_events", [True, False])
def test_validate_with_duplicate_hash(pair_of: Callable[..., Pair], record_events: bool) -> None:
    """A held publication whose hash is indexed already: the block stays VALIDATED and
    keeps the hash (a duplicate); a hash named twice in one call publishes the first."""
    pair = pair_of(8, record_events=record_events)
    (first,) = _published(pair, [H0])
    a, b, c = pair.ok("allocate_blocks", 3, write=True)
    publish = {a: (H0, None, "x"), b: (H1, H0, "y"), c: (H1, None, "z")}
    result = pair.ok("validate_blocks", [a, b, c], publish)
    assert (result.validated, result.published, result.duplicates) == ((a, b, c), (b,), (a, c))
    for pool in _both(pair):
        assert dict(pool.prefix_index) == {H0: first, H1: b}
        assert [(x.state, x.block_hash, x.parent_hash) for x in _blocks(pool, a, b, c)] == [
            (S.VALIDATED, H0, None),
            (S.PUBLISHED, H1, H0),
            (S.VALIDATED, H1, None),
        ]
        counters = pool.stats().counters
        assert (counters.blocks_published, counters.deferred_publications) == (2, 4)


@requires_speedups
@pytest.mark.parametrize("record_events", [True, False])
def test_validate_refusals_and_mappings(pair_of: Callable[..., Pair], record_events: bool) -> None:
    """An id named twice, a block not WRITTEN, ids outside the pool refuse the whole
    call; a read-only mapping and an empty dict are publications like any other."""
    pair = pair_of(6, record_events=record_events)
    a, b = pair.ok("allocate_blocks", 2, write=True)
    (c,) = pair.ok("allocate_blocks", 1)
    for ids in ([a, b, a], [a, c], [b, 6], [a, "1"], [b, True]):
        assert isinstance(pair.call("validate_blocks", ids), Raised), ids
    proxy = types.MappingProxyType({a: (H2, None, "o"), c: (H3, None, "o")})
    assert pair.ok("validate_blocks", [a, b], proxy).published == (a,)
    assert pair.ok("validate_blocks", [], {}).validated == ()


@requires_speedups
def test_validate_with_unhashable_held_hash(pair_of: Callable[..., Pair]) -> None:
    """A held publication whose hash is not bytes (a caller bug) is refused with
    PoolMisuseError before either pool changes (C leaves it to the Python path, which
    checks every publication first); both blocks stay WRITTEN, validatable."""
    pair = pair_of(4, record_events=False)
    a, b = pair.ok("allocate_blocks", 2, write=True)
    result = pair.call("validate_blocks", [a, b], {a: ([1], None, "o")})
    assert isinstance(result, Raised) and result.type is PoolMisuseError
    assert pair.ok("validate_blocks", [a, b]).validated == (a, b)


@requires_speedups
@pytest.mark.parametrize("steps_passed", [False, True])
def test_release_failing_half_way_changes_nothing(
    pair_of: Callable[..., Pair], steps_passed: bool
) -> None:
    """The third id has no reference left (DoubleFreeError), or is named once more than
    it is held (ForeignBlockError, found after the first two references were dropped):
    both pools are left exactly as they were -- no cached block enqueued."""
    pair = pair_of(8)
    cached, other = _published(pair, [H0, H1])
    pair.ok("release_blocks", [other])
    pair.ok("acquire_blocks", [other])
    (gone,) = pair.ok("allocate_blocks", 1)
    pair.ok("release_blocks", [gone])

    result = pair.call("release_blocks", [cached, other, gone], steps_passed=steps_passed)
    assert result == Raised(DoubleFreeError, f"block {gone} has no reference left to release")
    result = pair.call("release_blocks", [cached, other, cached], steps_passed=steps_passed)
    assert isinstance(result, Raised) and result.type is ForeignBlockError
    for pool in _both(pair):
        assert pool._kernel.free.snapshot()[2] == ()


@requires_speedups
@pytest.mark.parametrize("zero_policy", list(ZeroPolicy))
def test_quarantined_blocks_are_reused_first(
    pair_of: Callable[..., Pair], zero_policy: ZeroPolicy
) -> None:
    """Quarantined blocks waiting for reuse go first (the last one quarantined first),
    queued for zeroing under SUSPECT; every block under ALL."""
    pair = pair_of(6, zero_policy=zero_policy)
    a, b, c = pair.ok("allocate_blocks", 3, write=True)
    assert pair.ok("fail_blocks", [b, a]) == (b, a)
    pair.ok("release_blocks", [a, b])
    pair.ok("release_blocks", [c], steps_passed=True)
    pair.ok("take_blocks_to_zero")
    ids = pair.ok("allocate_blocks", 4)
    assert ids[:3] == [b, a, c], "quarantined ones (last in, first out), then FREE ones"
    zeroed = {ZeroPolicy.SUSPECT: (b, a), ZeroPolicy.ALL: tuple(ids), ZeroPolicy.NONE: ()}
    for pool in _both(pair):
        assert pool._kernel.zero.pending_blocks() == zeroed[zero_policy]


# -- the primitives themselves --------------------------------------------------------

ACCELERATED = ("allocate", "acquire", "release_table", "release_held", "validate_held")
"""The transition kernel's primitives that have compiled twins."""


@requires_speedups
def test_the_twins_are_exactly_the_accelerated_primitives(pair_of: Callable[..., Pair]) -> None:
    """A compiled kernel's accelerated primitives are the C methods themselves; the C
    type has no other primitive; a pure-Python kernel keeps its own methods."""
    from kvguard._speedups import FastPath
    from kvguard.transition_kernel import TransitionKernel

    pair = pair_of()
    public = {name for name in dir(FastPath) if not name.startswith("_")}
    assert public == {*ACCELERATED, "fallbacks"}
    for name in ACCELERATED:
        twin = getattr(pair.fast._kernel, name)
        assert isinstance(twin, types.BuiltinMethodType), name
        assert twin.__self__ is pair.fast._kernel._fast
        assert getattr(pair.pure._kernel, name).__func__ is getattr(TransitionKernel, name)
        # Same parameters, in the same order (the C one's from its docstring).
        python = list(inspect.signature(getattr(TransitionKernel, name)).parameters)[1:]
        assert twin.__doc__ is not None
        c_params = twin.__doc__.split("(", 1)[1].split(")", 1)[0].replace(" ", "").split(",")
        assert [p.replace("block_ids", "ids") for p in python] == c_params, name


def _primitive_cases(pair: Pair) -> list[tuple[str, tuple[Any, ...]]]:
    """Each accelerated primitive on ordinary input, on every kind of block it may be
    handed, and on malformed input (the drift case among them): the twins must agree.
    (Block-level references only: a request's come with its block table, which these
    direct calls do not keep; the request-level calls cover them.)"""
    w0, w1 = pair.ok("allocate_blocks", 2, write=True)
    (a,) = pair.ok("allocate_blocks", 1)
    pair.ok("add_request", "r", list(range(2 * BLOCK_SIZE)))
    pair.ok("allocate", "r", 2 * BLOCK_SIZE)
    pair.ok("write", "r", 2 * BLOCK_SIZE)
    pair.ok("validate_step", "r")
    r0, r1 = pair.fast.block_table("r")
    junk: list[Any] = [-1, 99, "1", True, 1.0]
    return [
        ("allocate", (0, True, False)),
        ("allocate", (-1, True, False)),
        ("allocate", (1, True, True)),
        ("allocate", (99, True, False)),
        ("acquire", ([r0], True)),
        ("acquire", ([r0, r1, r0], True)),
        ("acquire", ([a], True)),
        ("acquire", ([], True)),
        *[("acquire", ([r0, j], True)) for j in junk],
        ("release_held", ([r0, r0], False)),
        ("release_held", ([r1], False)),
        ("release_held", ([a, a], False)),
        *[("release_held", ([a, j], False)) for j in junk],
        ("validate_held", ([w0, w0], None)),
        ("validate_held", ([a], None)),
        ("validate_held", ([r1], None)),
        *[("validate_held", ([w0, j], None)) for j in junk],
        ("validate_held", ([w0], {w0: (b"h" * 8, 123, 456)})),  # the drift case
        ("validate_held", ([w1], {w1: (H0, None, "o")})),
        ("release_held", ([w0, w1, a], True)),
        ("release_held", ([r0], False)),
    ]


@requires_speedups
@pytest.mark.parametrize("record_events", [False, True])
def test_each_twin_agrees_with_its_primitive(
    pair_of: Callable[..., Pair], record_events: bool
) -> None:
    """Called directly, in one sequence, each twin and its Python primitive return the
    same or raise the same, and leave the kernels equal (``Pair.run`` compares)."""
    pair = pair_of(8, record_events=record_events)
    for name, args in _primitive_cases(pair):

        def primitive(pool: BlockPool, name: str = name, args: tuple[Any, ...] = args) -> object:
            return getattr(pool._kernel, name)(*args)

        pair.run(f"kernel.{name}{args!r}", primitive)
