"""Checks of the public API's arguments, run before a call changes anything.

Every public :class:`kvguard.BlockPool` method passes what a caller handed it through
these before it reads or writes a block: a wrong type or range becomes a
:class:`~kvguard.errors.PoolMisuseError` naming the argument, never a bare
``TypeError``/``KeyError`` from deep inside a half-done operation. The compiled fast
paths only ever see what passed here.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping
from typing import Any

from kvguard.block import PendingPublication
from kvguard.errors import PoolMisuseError
from kvguard.hashing import BlockHash


def request_id(value: object) -> str:
    if not isinstance(value, str):
        raise PoolMisuseError(f"a request id is a str, got {value!r}")
    return value


def count(name: str, value: object) -> int:
    """A non-negative int (``bool`` is refused: ``True`` is not a count)."""
    if type(value) is not int or value < 0:
        raise PoolMisuseError(f"{name} must be a non-negative int, got {value!r}")
    return value


def flag(name: str, value: object) -> bool:
    if value is not True and value is not False:
        raise PoolMisuseError(f"{name} must be a bool, got {value!r}")
    return value


def tier(value: object) -> str:
    if not isinstance(value, str):
        raise PoolMisuseError(f"a tier name is a str, got {value!r}")
    return value


def block_hash(name: str, value: object) -> BlockHash:
    if not isinstance(value, bytes):
        raise PoolMisuseError(f"{name} must be a block hash (bytes), got {value!r}")
    return value  # type: ignore[return-value]


def _listed(name: str, values: object) -> list[Any]:
    """``values`` as a list; one bare id or hash (or a str/bytes, iterable as its
    items) is refused, not iterated."""
    if type(values) is list:
        return values
    if type(values) is tuple:  # (no ABC checks on the common path)
        return list(values)
    if isinstance(values, (str, bytes, bytearray, Mapping)) or not isinstance(values, Iterable):
        raise PoolMisuseError(f"{name} must be a list or other iterable, got {values!r}")
    return list(values)


def id_list(values: object) -> list[int]:
    """Block ids as a list. Each id is range-checked where it is used (the pool's
    hot paths check ``type(id) is int`` and the range in the same pass)."""
    return _listed("block_ids", values)


_BYTES = frozenset({bytes})


def hash_list(name: str, values: object) -> list[BlockHash]:
    hashes = _listed(name, values)
    if not _BYTES.issuperset(map(type, hashes)):  # (one C-level pass for plain bytes)
        for value in hashes:
            if not isinstance(value, bytes):
                raise PoolMisuseError(f"{name} must hold block hashes (bytes), got {value!r}")
    return hashes


def token_array(values: object) -> array[int]:
    """Token ids as a compact int64 array; bad ids fail here, not mid-publication."""
    if type(values) is not list and type(values) is not tuple:  # (the common path: no ABCs)
        if isinstance(values, (str, bytes, bytearray, Mapping)) or not isinstance(values, Iterable):
            raise PoolMisuseError(f"token_ids must be a sequence of ints, got {values!r}")
        if isinstance(values, array) and values.typecode != "q":
            values = values.tolist()
    try:
        return array("q", values)
    except (TypeError, OverflowError) as exc:
        raise PoolMisuseError(f"token ids must be ints in int64 range: {exc}") from None


def publication(block_id: object, value: object) -> PendingPublication:
    """``(hash: bytes, parent hash: bytes | None, owner: str)``; anything else is refused
    before the pool changes (an unhashable hash would fail half-way through)."""
    if not (
        type(value) is tuple
        and len(value) == 3
        and isinstance(value[0], bytes)
        and (value[1] is None or isinstance(value[1], bytes))
        and isinstance(value[2], str)
    ):
        raise PoolMisuseError(
            f"block {block_id!r}: a publication is (hash: bytes, parent hash: bytes | None, "
            f"owner: str), got {value!r}"
        )
    return value


def publications(
    values: object,
) -> Mapping[int, PendingPublication] | None:
    """``validate_blocks``' ``publish``: None, or a mapping of id to publication (every
    entry checked, also those for ids the call does not validate)."""
    if values is None:
        return None
    if not isinstance(values, Mapping):
        raise PoolMisuseError(f"publish must be a dict of block id -> publication, got {values!r}")
    for block_id, value in values.items():
        if type(block_id) is not int:
            raise PoolMisuseError(f"publish is keyed by block id (int), got {block_id!r}")
        if not (  # publication()'s test, inlined: this runs once per block of a step
            type(value) is tuple
            and len(value) == 3
            and isinstance(value[0], bytes)
            and (value[1] is None or isinstance(value[1], bytes))
            and isinstance(value[2], str)
        ):
            publication(block_id, value)  # raises, naming the block
    return values
