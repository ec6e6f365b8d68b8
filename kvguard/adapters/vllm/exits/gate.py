"""The exit gate: the one place that decides whether KV may leave a guarded instance.

Every way KV leaves -- a CPU tier (vLLM's offloading, SimpleCPU), shared storage, a
prefill/decode transfer -- asks the same question: *may this request's leading blocks
leave now, and under which keys?* Connectors are thin adapters from their vLLM hook to
an :class:`ExitGate`; none reads a block record itself
(``tests/test_exits_read_no_block_state.py`` fails if one does). The gate owns:

* **the rule** -- a block may leave for a request only when it is VALIDATED or later and
  carries this request's key at its position: the core's predicate
  (:func:`kvguard.tier_gate.storable_as`), asked by :meth:`ExitGate.storable`,
  :meth:`ExitGate.frontier` and :meth:`ExitGate.verdict`;
* **the key** of block n of group g (:func:`group_key`, :func:`group_hashes`): vLLM's
  block hash at the group's block size plus the group id's 4 big-endian bytes, which is
  what kvguard's pool publishes (vLLM's ``make_block_hash_with_group_id``);
* **the validated frontier** per (request, group): how many leading blocks may leave,
  kept as a cursor that only moves forward, so that a step where nothing regressed
  costs a dict lookup and one block read (:meth:`ExitGate.frontier`);
* **the tickets** of each copy (:meth:`ExitGate.open`, :meth:`ExitGate.settle`,
  :meth:`ExitGate.fail`): opened at pick (the core's ``begin_store``), acknowledged or
  failed by the copy; a block quarantined, invalidated or reused meanwhile makes its
  acknowledgement late (the core drops it) and the copy is discarded;
* **the tier record** -- which copies the tier holds, and the hashes in each
  (:meth:`ExitGate.record`, :meth:`ExitGate.forget`), so that kvguard's record of tier
  copies names only what the tier holds and a purge finds what to drop;
* **purge registration** (:meth:`ExitGate.bind` registers the tier's purger with the
  pool's :class:`~kvguard.adapters.vllm.exits.tier_purge.TierPurgers`);
* **the counters**, under the names of its tier's scheme (:mod:`..metrics`);
* **verified loads** (seals on): what a load carries to the workers
  (:data:`LOAD_SEALS`), and where they can be verified (:func:`refuse_seals_for_groups`);
* **the request-finished gate** for connectors that ship a finished request's KV
  (NIXL, Mooncake, MoRIIO in read mode): :func:`withhold_from_connector`.

Importing this module imports vLLM (``resolve_block_hashes``, ``RequestStatus``) but
not the guarded pool, which imports :func:`group_suffix` from here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_utils import resolve_block_hashes
from vllm.v1.request import RequestStatus

from kvguard.adapters.vllm.config import GuardConfigError
from kvguard.errors import NotStorableError, PoolMisuseError
from kvguard.hashing import BlockHash
from kvguard.results import StoreTicket
from kvguard.states import BlockState
from kvguard.tier_gate import storable_as

if TYPE_CHECKING:
    from kvguard.adapters.vllm.exits.tier_purge import TierPurger
    from kvguard.adapters.vllm.pool.block_pool import GuardedBlockPool

logger = init_logger(f"vllm.{__name__}")
"""Under vLLM's logger, as the scheduler's: vLLM's handler, format and level apply."""

_WRITTEN = BlockState.WRITTEN


# ---------------------------------------------------------------------- keys


@functools.cache
def group_suffix(group_id: int) -> bytes:
    """What ``make_block_hash_with_group_id`` appends to a block hash: the group id's 4
    big-endian bytes. (Cached: the guarded pool's prefix lookup calls it per block.)"""
    return group_id.to_bytes(4, "big", signed=False)


def group_key(block_hash: bytes, group_id: int) -> BlockHash:
    """kvguard's key of a block of group ``group_id`` whose vLLM hash (at the group's
    block size) is ``block_hash``."""
    return BlockHash(block_hash + group_suffix(group_id))


def group_hashes(
    request_hashes: Sequence[bytes], hash_block_size: int, block_size: int
) -> Sequence[bytes]:
    """A request's block hashes at a group's ``block_size``: the request's own list
    when the sizes agree, else vLLM's view of it at that size (a lazy view that grows
    with the list)."""
    if block_size == hash_block_size:
        return request_hashes
    return resolve_block_hashes(request_hashes, hash_block_size, block_size)


def group_keys(block_hashes: Iterable[bytes], num_groups: int) -> list[BlockHash]:
    """kvguard's keys of these vLLM hashes in every one of ``num_groups`` groups (what
    an invalidation by vLLM hash taints)."""
    return [group_key(h, g) for h in block_hashes for g in range(num_groups)]


# ---------------------------------------------------------------------- the gate


class ExitGateUnbound(PoolMisuseError):
    """A gate call that needs kvguard's pool on a gate bound to none (a caller bug: the
    connector runs on vLLM's own pool, and has nothing to gate)."""


@dataclass(slots=True)
class _Frontier:
    """A (request, group)'s validated frontier as last verified."""

    n: int
    """Leading blocks verified storable under the request's keys (from the caller's
    ``start`` on; those before were offered already)."""
    epoch: int
    """The pool's exit epoch when verified (:meth:`TierGate.exit_epoch`)."""
    source: Sequence[bytes]
    """The request's hash list the keys came from (a new list: keys computed again)."""
    hashes: Sequence[bytes]
    """Its view at the group's block size."""
    suffix: bytes
    """The group's key suffix (:func:`group_suffix`)."""
    last: int
    """The id of block ``n - 1`` (-1: none), and below its generation then: a table
    built again (a request preempted and resumed) holds another block there, or the
    same one handed out again."""
    last_generation: int


@dataclass(frozen=True, slots=True)
class PendingExit:
    """Blocks written by a step not judged yet, that are to leave as ``keys`` once it
    validates (:meth:`ExitGate.pend`, :meth:`ExitGate.verdict`)."""

    block_ids: tuple[int, ...]
    keys: tuple[BlockHash, ...]
    generations: tuple[int, ...]
    """Each block's generation when pended: one released since has another."""


class ExitGate:
    """One connector's exit through kvguard: its tier name, its pool (None while the
    connector runs on vLLM's own pool: the guard off), its tickets, its tier record and
    its counters.

    Build one per connector (scheduler side) with the tier name kvguard records its
    copies under and the counter names of its scheme; :meth:`bind` it to the pool the
    scheduler's KV cache manager holds whenever vLLM (or the guarded scheduler, after
    installing kvguard's pool) binds the connector.
    """

    def __init__(self, tier: str, counter_names: Iterable[str]) -> None:
        self.tier = tier
        self.counters: dict[str, int] = dict.fromkeys(counter_names, 0)
        self._pool: GuardedBlockPool | None = None
        self._exit_epoch: Callable[[], int] | None = None
        self._frontiers: dict[tuple[str, int], _Frontier] = {}
        # request -> (exit epoch, preemptions, tokens) of its last answer in every
        # group (:meth:`note_cleared`, :meth:`clears`).
        self._cleared: dict[str, tuple[int, int, int]] = {}
        # The tier record: copy (an offload key, a folder, a hash) -> the keys it holds,
        # and per key how many recorded copies hold it.
        self._copies: dict[Any, tuple[BlockHash, ...]] = {}
        self._holders: dict[BlockHash, int] = {}

    # ------------------------------------------------------------------ binding

    def bind(self, pool: Any, purge: TierPurger | None = None) -> GuardedBlockPool | None:
        """Bind to ``pool`` (the KV cache manager's): kvguard's pool is kept, and the
        tier's ``purge`` registered with it; any other (vLLM's own) leaves the gate
        unbound, the connector then vLLM's own. Returns kvguard's pool, or None."""
        from kvguard.adapters.vllm.pool.block_pool import GuardedBlockPool

        if not isinstance(pool, GuardedBlockPool):
            self._pool = None
            self._exit_epoch = None
            return None
        if pool is not self._pool:
            self._frontiers.clear()
            self._cleared.clear()
        self._pool = pool
        self._exit_epoch = pool.core.tier_gate.exit_epoch
        if purge is not None:
            pool.tier_purgers.add(self.tier, purge)
        return pool

    @property
    def pool(self) -> GuardedBlockPool | None:
        """kvguard's pool, or None (vLLM's own pool: the connector is vLLM's own)."""
        return self._pool

    # ------------------------------------------------------------------ the rule

    def storable(self, block_id: int, key: BlockHash) -> bool:
        """Whether block ``block_id`` may leave now as ``key`` (the core's rule)."""
        pool = self._pool
        return pool is not None and storable_as(pool.blocks[block_id], key)

    def frontier(
        self,
        request_id: str,
        group_id: int,
        block_ids: Sequence[int],
        request_hashes: Sequence[bytes],
        block_size: int,
        start: int = 0,
        *,
        null_passes: bool = False,
        held: bool = True,
    ) -> int:
        """How many of the request's leading blocks of group ``group_id`` may leave:
        from ``start`` (the blocks before it were offered already, and are not asked
        about), each block of ``block_ids`` storable under the request's key at its
        position (at most the blocks both lists cover; 0 when the gate is unbound).

        ``block_ids`` is the request's block table of that group as the connector keeps
        it (appended to as the request runs), ``request_hashes`` the request's vLLM
        block hashes (at the pool's hash block size), ``block_size`` the group's. The
        null block stops the frontier, unless ``null_passes`` (a connector that stores
        past a window's freed blocks). ``held``: the request holds every block of
        ``block_ids`` while it runs (full attention); False for a group whose blocks
        leave the request as it runs (a window) while the connector keeps their ids --
        such a frontier is verified from ``start`` at every call.

        Runtime: O(1) amortized per call. The answer is kept per (request, group) and
        moved only forward, from where it stopped; it is verified again from ``start``
        when anything may have moved a block back since -- a quarantine, eviction,
        invalidation or rollback anywhere in the pool (the pool's exit epoch), or a
        block table built again (the block last verified is not there, or was handed
        out again). Blocks the request holds are never rewritten or reused while it
        holds them, so nothing else can make a verified block unstorable.
        """
        pool = self._pool
        exit_epoch = self._exit_epoch
        if pool is None or exit_epoch is None:
            return 0
        records = pool.blocks
        epoch = exit_epoch()
        known = self._frontiers.get((request_id, group_id))
        if known is None or known.source is not request_hashes:
            hashes = group_hashes(request_hashes, pool.hash_block_size, block_size)
            known = _Frontier(start, epoch, request_hashes, hashes, group_suffix(group_id), -1, 0)
            self._frontiers[(request_id, group_id)] = known
        n = known.n
        moved = False
        if n <= start:
            moved = n < start
            n = start
        elif not (  # the blocks verified up to n must still be the request's, unmoved
            held
            and known.epoch == epoch
            and known.last >= 0
            and n <= len(block_ids)
            and block_ids[n - 1] == known.last
            and records[known.last].generation == known.last_generation
        ):
            n = start  # verify again
            moved = True
        known.epoch = epoch
        hashes = known.hashes
        end = min(len(block_ids), len(hashes))
        if n >= end:
            n = end  # (no block, or no hash yet, past the end: nothing to offer there)
        else:
            suffix = known.suffix
            while n < end:
                block = records[block_ids[n]]
                if block.is_null:
                    if not null_passes:
                        break
                elif not storable_as(block, hashes[n] + suffix):  # type: ignore[arg-type]
                    break
                n += 1
        if moved or n != known.n:
            known.n = n
            last = block_ids[n - 1] if n else -1
            if last < 0 or records[last].is_null:
                known.last = -1  # (nothing verified to trust: verified again next time)
            else:
                known.last = last
                known.last_generation = records[last].generation
        return n

    def note_cleared(self, request_id: str, preemptions: int, tokens: int) -> None:
        """The request's frontiers, asked just now with it holding its blocks (running,
        preempted ``preemptions`` times so far), let ``tokens`` of its leading tokens
        leave in every group: :meth:`clears` answers from this until it may be stale."""
        exit_epoch = self._exit_epoch
        if exit_epoch is not None:
            self._cleared[request_id] = (exit_epoch(), preemptions, tokens)

    def clears(self, request_id: str, preemptions: int, tokens: int) -> bool:
        """Whether the request's leading ``tokens`` may leave, known without asking its
        frontiers: they are within what :meth:`note_cleared` last recorded, and nothing
        can have moved a block it holds back since -- the pool's exit epoch is the same
        and the request was not preempted (its block table is only appended to). False
        means: ask :meth:`frontier`. O(1): one dict lookup."""
        known = self._cleared.get(request_id)
        return (
            known is not None
            and tokens <= known[2]
            and known[1] == preemptions
            and self._exit_epoch is not None
            and known[0] == self._exit_epoch()
        )

    def forget_cleared(self, request_id: str) -> None:
        """Drop what :meth:`note_cleared` recorded for the request (a store of it the
        core refused: its frontiers are asked again)."""
        self._cleared.pop(request_id, None)

    def forget_requests(self, keep: Collection[str] = ()) -> None:
        """Drop the frontiers of every request not in ``keep`` (requests gone)."""
        frontiers = self._frontiers
        for key in [k for k in frontiers if k[0] not in keep]:
            del frontiers[key]
        cleared = self._cleared
        for request_id in [r for r in cleared if r not in keep]:
            del cleared[request_id]

    def num_frontiers(self) -> int:
        """How many (request, group) frontiers the gate keeps."""
        return len(self._frontiers)

    def pend(self, block_ids: Sequence[int], keys: Sequence[BlockHash]) -> PendingExit:
        """Blocks a step is writing, to leave as ``keys`` once that step validates:
        judged by :meth:`verdict`. Needs a bound gate."""
        pool = self._bound()
        records = pool.blocks
        generations = tuple(records[b].generation for b in block_ids)
        return PendingExit(tuple(block_ids), tuple(keys), generations)

    def verdict(self, pending: PendingExit) -> bool | None:
        """True when every block of ``pending`` may leave as its key; None while one is
        still being written (its step not judged yet); False when one never will
        (quarantined, released since, or holding other tokens now)."""
        records = self._bound().blocks
        verdict: bool | None = True
        for block_id, key, generation in zip(
            pending.block_ids, pending.keys, pending.generations, strict=True
        ):
            block = records[block_id]
            if block.generation != generation:
                return False  # released since (quarantined, or reused)
            if block.state is _WRITTEN:
                verdict = None
            elif not storable_as(block, key):
                return False
        return verdict

    # ------------------------------------------------------------------ tickets

    def open(self, block_id: int) -> StoreTicket | None:
        """A ticket for copying block ``block_id`` to the tier, or None if kvguard
        refuses it (not VALIDATED or later, or unhashed). Needs a bound gate."""
        try:
            return self._bound().core.tier_gate.begin_store(block_id, self.tier)
        except NotStorableError:
            return None

    def open_each(self, block_ids: Iterable[int]) -> list[StoreTicket | None]:
        """:meth:`open` for each of ``block_ids``, in one call (a store event of
        single-block copies): a ticket per block, None where kvguard refuses it."""
        begin_store = self._bound().core.tier_gate.begin_store
        tier = self.tier
        tickets: list[StoreTicket | None] = []
        for block_id in block_ids:
            try:
                tickets.append(begin_store(block_id, tier))
            except NotStorableError:
                tickets.append(None)
        return tickets

    def open_all(self, block_ids: Iterable[int]) -> list[StoreTicket] | int:
        """Tickets for every block but the null block (a window's freed position: not
        copied), or -- if kvguard refuses one -- that block's id, with the tickets
        opened before it failed."""
        pool = self._bound()
        records = pool.blocks
        begin_store = pool.core.tier_gate.begin_store
        tier = self.tier
        tickets: list[StoreTicket] = []
        for block_id in block_ids:
            if records[block_id].is_null:
                continue
            try:
                tickets.append(begin_store(block_id, tier))
            except NotStorableError:
                self.fail(tickets)
                return block_id
        return tickets

    def ack(self, ticket: StoreTicket) -> bool:
        """The copy of one block completed: True if kvguard registers it as a tier
        copy, False if it came too late (the block was quarantined, invalidated or
        reused since the copy began): the tier must discard it."""
        return self._bound().core.tier_gate.ack_store(ticket)

    def fail(self, tickets: Iterable[StoreTicket]) -> None:
        """These copies failed or were abandoned: none becomes a tier copy."""
        pool = self._pool
        if pool is None:
            return
        fail_store = pool.core.tier_gate.fail_store
        for ticket in tickets:
            fail_store(ticket)

    def settle(self, copy: Any, tickets: Sequence[StoreTicket]) -> bool:
        """Every block of one tier copy (``copy``: the tier's name for it) was copied:
        acknowledge each ticket. True: the copy is recorded (:meth:`record`). False:
        one came too late, and the copy goes as a whole -- the tier must discard it;
        its other blocks' records are withdrawn."""
        core = self._bound().core.tier_gate  # (the façade itself: one call less per block)
        ack = core.ack_store
        acks = [ack(ticket) for ticket in tickets]
        if False not in acks:
            self.record(copy, tuple([ticket.block_hash for ticket in tickets]))
            return True
        holders = self._holders
        for ticket, ok in zip(tickets, acks, strict=True):
            if ok and ticket.block_hash not in holders:
                core.forget_tier_copy(self.tier, ticket.block_hash)
        return False

    def settle_each(self, copies: Sequence[Any], tickets: Sequence[StoreTicket]) -> list[int]:
        """:meth:`settle` for single-block copies, in one call: ``tickets[i]`` is the
        one block of copy ``copies[i]``. Returns the indices of the copies whose
        acknowledgement came too late (the tier must discard them); the others are
        recorded."""
        ack = self._bound().core.tier_gate.ack_store
        record = self.record
        late: list[int] = []
        for index, ticket in enumerate(tickets):
            if ack(ticket):
                record(copies[index], (ticket.block_hash,))
            else:
                late.append(index)
        return late

    # ------------------------------------------------------------------ the tier record

    def record(self, copy: Any, keys: tuple[BlockHash, ...]) -> None:
        """The tier holds ``copy``, a copy of the blocks of these keys (registered with
        the core through :meth:`settle`, or acknowledged one by one)."""
        old = self._copies.get(copy)
        self._copies[copy] = keys
        holders = self._holders
        for key in keys:
            holders[key] = holders.get(key, 0) + 1
        if old is not None:  # (after: a key both hold keeps kvguard's record of it)
            self._release(old)

    def holds(self, copy: Any) -> bool:
        """Whether the record names ``copy``."""
        return copy in self._copies

    def copies(self) -> list[Any]:
        """Every copy the record names."""
        return list(self._copies)

    def recorded(self) -> Mapping[Any, tuple[BlockHash, ...]]:
        """The record, read-only: copy -> the keys it holds."""
        return MappingProxyType(self._copies)

    def held_keys(self) -> Collection[BlockHash]:
        """Every key some recorded copy holds (kvguard records a tier copy of each)."""
        return self._holders.keys()

    def copies_holding(self, keys: Iterable[BlockHash]) -> dict[Any, tuple[BlockHash, ...]]:
        """The recorded copies holding one of ``keys``, and the keys each holds (a
        purge's scan: invalidations are rare, the record is the tier's size)."""
        wanted = set(keys)
        if wanted.isdisjoint(self._holders):
            return {}
        return {c: held for c, held in self._copies.items() if not wanted.isdisjoint(held)}

    @staticmethod
    def purged_keys(
        held: Iterable[tuple[BlockHash, ...]], hashes: Iterable[BlockHash]
    ) -> list[BlockHash]:
        """The keys of ``hashes`` that the dropped copies ``held`` (their keys, from
        :meth:`copies_holding`) held, each once: what a tier's purger returns."""
        wanted = set(hashes)
        return list(dict.fromkeys(h for keys in held for h in keys if h in wanted))

    def forget(self, copies: Iterable[Any]) -> int:
        """The tier no longer holds these copies (evicted, dropped, purged): forget
        them, and withdraw kvguard's record of every key no other recorded copy holds.
        Returns how many of them the record named."""
        recorded = self._copies
        forgotten = 0
        for copy in copies:
            keys = recorded.pop(copy, None)
            if keys is not None:
                forgotten += 1
                self._release(keys)
        return forgotten

    def _release(self, keys: tuple[BlockHash, ...]) -> None:
        holders = self._holders
        pool = self._pool
        for key in keys:
            left = holders.get(key, 0) - 1
            if left > 0:
                holders[key] = left
                continue
            holders.pop(key, None)
            if pool is not None:
                pool.core.tier_gate.forget_tier_copy(self.tier, key)

    # ------------------------------------------------------------------ counters

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``name`` (one of the gate's names)."""
        self.counters[name] += n

    def stats(self) -> dict[str, int]:
        """A copy of the counters."""
        return dict(self.counters)

    def _bound(self) -> GuardedBlockPool:
        pool = self._pool
        if pool is None:
            raise ExitGateUnbound(
                f"the exit gate of tier {self.tier!r} is not bound to kvguard's pool "
                "(the connector runs on vLLM's own pool): nothing to gate"
            )
        return pool


# ---------------------------------------------------------------------- verified loads


LOAD_SEALS = "kvguard_load_seals"
"""The connector metadata's attribute with the seals each load must give: load job id
(SimpleCPU: load event) -> GPU block id -> the seal its copy carries (None: the copy
carries none, and is refused)."""


def refuse_seals_for_groups(kv_cache_config: Any) -> None:
    """Seals verify a CPU tier's loads block by block, and vLLM maps a block that failed
    to load back to its request on models with one KV cache group only (with several
    it stops the engine): refuse seals with a CPU tier on any other model."""
    groups = len(kv_cache_config.kv_cache_groups)
    if groups > 1:
        raise GuardConfigError(
            'kvguard\'s seals ("seal": true) verify CPU-tier loads block by block, and '
            "vLLM maps a block that failed to load back to its request on models with "
            f"one KV cache group only; this model has {groups}. Switch seals off to "
            "offload its KV (stores stay gated; loads are then not verified)."
        )


# ---------------------------------------------------------------------- request-finished gate


NORMAL_ENDS = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED})
"""How a request ends normally: a connector hands its KV on only then."""


def withhold_from_connector(
    call: Callable[[Any], tuple[bool, Mapping[str, Any] | None]], request: Any
) -> tuple[bool, dict[str, Any] | None]:
    """Run vLLM's ``_connector_finished`` (``call``) for a request that did not end
    after clean, counted steps: the connector is shown the request as aborted -- every
    connector vLLM ships then sends and keeps nothing of it (a pending receive is
    cleaned up as for a client abort) -- and no transfer parameters reach the client.
    Returns whether vLLM must keep the blocks for the connector (it may still read
    them for a transfer in flight), and None."""
    status = request.status
    request.status = RequestStatus.FINISHED_ABORTED
    try:
        delay_free, _ = call(request)
    finally:
        request.status = status
    if status in NORMAL_ENDS:
        logger.warning(
            "kvguard: request %s finished, but its last step was not counted clean (no "
            "NaN count for it, or a step still in flight): its KV is not handed to the "
            "KV connector (no send, no save); a decode instance computes it afresh",
            request.request_id,
        )
    return bool(delay_free), None
