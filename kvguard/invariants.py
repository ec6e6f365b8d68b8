"""The pool's invariants, checked by walking everything (docs/design.md rules 1-5).

Kept apart from the pool so the pool reads as the operations and this file as the
contract. It reads the pool's private fields on purpose: it is the pool's own auditor.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvguard.block import BlockInfo
from kvguard.errors import InvariantViolation
from kvguard.hashing import BlockHash
from kvguard.results import SlotRange
from kvguard.states import MATCHABLE_STATES, STORABLE_STATES, BlockState
from kvguard.stats import Counters

if TYPE_CHECKING:
    from kvguard.pool import BlockPool

S = BlockState
_EXCLUSIVE = frozenset({S.ALLOCATED, S.WRITTEN, S.VALIDATED})


def check_pool(pool: BlockPool) -> None:
    problems: list[str] = []
    add = problems.append
    size = pool.block_size
    blocks = pool._kernel.blocks

    # Rule 4: reference counts are exactly the table entries plus block-level holders.
    table_refs: Counter[int] = Counter()
    for rid, rec in pool._core.requests.items():
        if len(set(rec.blocks)) != len(rec.blocks):
            add(f"request {rid!r} lists a block twice: {rec.blocks}")
        table_refs.update(rec.blocks)
    for block in blocks:
        expected = table_refs[block.block_id] + block.external_refs
        if block.ref_cnt != expected:
            add(
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, but {table_refs[block.block_id]}"
                f" table refs + {block.external_refs} block-level refs"
            )
        if block.state is S.FREE and block.ref_cnt:
            add(f"block {block.block_id} is FREE with ref_cnt {block.ref_cnt}")
        if block.state in _EXCLUSIVE and block.ref_cnt > 1:
            add(f"block {block.block_id} is {block.state.name} but owned {block.ref_cnt} times")
        if block.state in MATCHABLE_STATES and block.block_hash is None:
            add(f"block {block.block_id} is {block.state.name} without a hash")
        if block.block_hash is not None and block.state not in STORABLE_STATES:
            add(f"block {block.block_id} is {block.state.name} but keeps hash")
    # Block-level step ledger (write_blocks / publish_block), in the kernel's side tables.
    kernel = pool._kernel
    for bid, writers in kernel.writers.items():
        block = blocks[bid]
        if writers < 1 or block.state is not S.WRITTEN or not block.external_refs:
            add(
                f"block {bid} has {writers} block-level writers but is "
                f"{block.state.name} with {block.external_refs} block-level refs"
            )
    for bid in kernel.deferred:
        block = blocks[bid]
        if block.state not in (S.ALLOCATED, S.WRITTEN) or not block.ref_cnt:
            add(
                f"block {bid} waits to be published but is {block.state.name} "
                f"with ref_cnt {block.ref_cnt}"
            )
    if any(not retention for retention in kernel.retention.values()):
        add("the retention map keeps a class 0 (absent means 0)")

    # Rule 4: the free queue holds exactly the blocks with no reference, each once,
    # each in the tier its state calls for.
    quarantined, empty, evictable = pool._kernel.free.snapshot()
    queued = quarantined + empty + evictable
    if len(set(queued)) != len(queued):
        add(f"free queue lists a block twice: {sorted(queued)}")
    if pool._kernel.free.size != len(queued):
        add(f"free queue counts {pool._kernel.free.size} blocks, holds {len(queued)}")
    unreferenced = {b.block_id for b in blocks if b.ref_cnt == 0}
    if set(queued) != unreferenced:
        add(
            f"free queue {sorted(queued)} is not the set of unreferenced blocks "
            f"{sorted(unreferenced)}"
        )
    for bid in quarantined:
        if blocks[bid].state is not S.QUARANTINED:
            add(f"block {bid} in the quarantine tier is {blocks[bid].state.name}")
    for bid in empty:
        if blocks[bid].state is not S.FREE:
            add(f"block {bid} in the empty tier is {blocks[bid].state.name}")
    for bid in evictable:
        if blocks[bid].state not in MATCHABLE_STATES:
            add(f"block {bid} in the evictable tier is {blocks[bid].state.name}")
    classes = pool._kernel.free.evictable
    lowest = classes.peekitem(0) if classes else None
    first = pool._kernel.free.first
    if (first is None) != (lowest is None) or (
        first is not None
        and lowest is not None
        and (first[0] != lowest[0] or first[1] is not lowest[1])
    ):
        add(f"free queue's first eviction class {first!r} is not the lowest {lowest!r}")
    if any(not bucket for bucket in classes.values()):
        add("free queue keeps an empty eviction class")
    classes_of = pool._kernel.retention
    for retention, bucket in pool._kernel.free.evictable.items():
        for bid in bucket:
            if classes_of.get(bid, 0) != retention:
                add(
                    f"block {bid} sits in retention class {retention}, has {classes_of.get(bid, 0)}"
                )

    # Rule 1: the index maps exactly the matchable blocks, each under its own hash.
    for block_hash, bid in pool._kernel.index.items():
        block = blocks[bid]
        if block.state not in MATCHABLE_STATES or block.block_hash != block_hash:
            add(f"index entry {block_hash.hex()} -> block {bid} ({block.state.name})")
    matchable = [b for b in blocks if b.state in MATCHABLE_STATES]
    if len(matchable) != len(pool._kernel.index):
        add(f"{len(matchable)} matchable blocks but {len(pool._kernel.index)} index entries")
    # Nothing matchable carries a hash found corrupt (invalidate) and not recomputed.
    tainted = pool._kernel.tainted
    for block in matchable if tainted else ():
        if block.block_hash in tainted:
            add(f"block {block.block_id} is {block.state.name} under a tainted hash")

    # Rule 5 and the ledger: each request's blocks agree with its boundaries.
    for rid, rec in pool._core.requests.items():
        if not 0 <= rec.num_validated <= rec.num_written <= len(rec.blocks) * size:
            add(
                f"request {rid!r}: validated {rec.num_validated}, written {rec.num_written}, "
                f"capacity {len(rec.blocks) * size}"
            )
        ends = list(rec.pending)
        if ends != sorted(set(ends)) or (ends and ends[0] <= rec.num_validated):
            add(f"request {rid!r}: pending step ends {ends} not increasing past validated")
        if not rec.aborted and (ends[-1] if ends else rec.num_validated) != rec.num_written:
            add(f"request {rid!r}: pending steps {ends} do not end at written {rec.num_written}")
        if rec.aborted and rec.pending:
            add(f"request {rid!r} is aborted but has pending steps {ends}")
        for i, bid in enumerate(rec.blocks):
            state = blocks[bid].state
            lo, hi = i * size, min((i + 1) * size, rec.num_written)
            if state is S.QUARANTINED:
                # A failed step, or a hash tainted after the fact: either way the
                # request is aborted, and no whole quarantined block counts as validated.
                if not rec.aborted or rec.num_validated >= lo + size:
                    add(
                        f"request {rid!r} holds quarantined block #{i} (id {bid}) but is "
                        f"{'aborted' if rec.aborted else 'live'} with validated={rec.num_validated}"
                    )
                continue
            if lo >= rec.num_written:
                ok = state is S.ALLOCATED
            elif hi <= rec.num_validated:
                ok = state in STORABLE_STATES
            else:
                ok = state is S.WRITTEN
            if not ok:
                add(
                    f"request {rid!r} block #{i} (id {bid}, tokens {lo}..{hi}) is "
                    f"{state.name} with validated={rec.num_validated} written={rec.num_written}"
                    f" aborted={rec.aborted}"
                )

    # Rule 2: every store in flight names a real block.
    for ticket in pool._core.tiers.tickets.values():
        if not 0 <= ticket.block_id < pool.num_blocks:
            add(f"store ticket {ticket.ticket_id} names block {ticket.block_id}")
    # A tier copy's seal belongs to a copy the tier holds.
    copies = pool._core.tiers.copies
    for block_hash, tier in pool._core.tiers.seals:
        if tier not in copies.get(block_hash, ()):
            add(f"tier {tier!r} has a seal for {block_hash.hex()} but no copy of it")

    if problems:
        raise InvariantViolation(
            "kvguard pool invariants broken:\n  - "
            + "\n  - ".join(problems)
            + f"\nstate counts: { {s.name: n for s, n in pool._blocks_by_state().items()} }"
            + f"\nfree queue: quarantined={quarantined} empty={empty} evictable={evictable}"
        )


@dataclass(frozen=True)
class RequestSnapshot:
    request_id: str
    blocks: tuple[int, ...]
    num_written: int
    num_validated: int
    pending: tuple[int, ...]
    discarded: tuple[int, ...]
    aborted: bool
    token_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]
    publish_cursor: int


@dataclass(frozen=True)
class PoolSnapshot:
    """Everything observable about a pool; equal snapshots mean nothing changed."""

    blocks: tuple[
        tuple[
            BlockInfo,
            int,
            BlockHash | None,
            int,
            tuple[BlockHash, BlockHash | None, str] | None,
        ],
        ...,
    ]
    """Per block: info, external refs, parent hash, block-level writers in flight,
    pending publication."""
    free_queue: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    index: tuple[tuple[BlockHash, int], ...]
    requests: tuple[RequestSnapshot, ...]
    zero_blocks: tuple[int, ...]
    zero_slots: tuple[SlotRange, ...]
    num_events: int
    tickets: tuple[int, ...]
    tier_copies: tuple[tuple[BlockHash, tuple[str, ...]], ...]
    tainted: tuple[BlockHash, ...]
    counters: Counters
    seals: tuple[tuple[int, tuple[int, int]], ...] = ()
    """Per block id: (generation, seal) as recorded at validation."""
    tier_seals: tuple[tuple[tuple[BlockHash, str], int], ...] = ()


def take_snapshot(pool: BlockPool) -> PoolSnapshot:
    kernel = pool._kernel
    retention, writers, pending = kernel.retention, kernel.writers, kernel.deferred
    return PoolSnapshot(
        blocks=tuple(
            (
                BlockInfo.of(b, retention.get(b.block_id, 0)),
                b.external_refs,
                b.parent_hash,
                writers.get(b.block_id, 0),
                pending.get(b.block_id),
            )
            for b in kernel.blocks
        ),
        free_queue=pool._kernel.free.snapshot(),
        index=tuple(sorted(pool._kernel.index.items())),
        requests=tuple(
            RequestSnapshot(
                rid,
                tuple(rec.blocks),
                rec.num_written,
                rec.num_validated,
                tuple(rec.pending),
                tuple(rec.discarded),
                rec.aborted,
                tuple(rec.token_ids),
                tuple(rec.block_hashes),
                rec.publish_cursor,
            )
            for rid, rec in sorted(pool._core.requests.items())
        ),
        zero_blocks=pool._kernel.zero.pending_blocks(),
        zero_slots=pool._kernel.zero.pending_slots(),
        num_events=len(pool._kernel.events),
        tickets=tuple(sorted(pool._core.tiers.tickets)),
        tier_copies=tuple(
            sorted((h, tuple(sorted(t))) for h, t in pool._core.tiers.copies.items())
        ),
        tainted=tuple(sorted(pool._kernel.tainted)),
        counters=dataclasses.replace(pool._kernel.counters),
        seals=tuple(sorted(pool._core.seals.items())),
        tier_seals=tuple(sorted(pool._core.tiers.seals.items())),
    )
