"""Checks of the public API's arguments, run before a call changes anything.

Every public :class:`kvguard.BlockPool` method passes what a caller handed it through
these before it reads or writes a block: a wrong type or range becomes a
:class:`~kvguard.errors.PoolMisuseError` naming the argument and the type it got, never
a bare ``TypeError``/``KeyError`` from deep inside a half-done operation. The compiled
fast paths only ever see what passed here.

Integers: wherever the API takes an int (a count, a block id), anything with
``__index__`` (numpy integers, for instance) is accepted and converted to an int; a
``bool`` is refused (``True`` is neither a count nor a block id), and so is a float,
even an integral one. The hot paths test ``type(x) is int`` first and convert only
what is not an int already.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Iterable, Mapping
from typing import Any, SupportsIndex, cast

from kvguard.block import PendingPublication
from kvguard.errors import PoolMisuseError, UnknownBlockError
from kvguard.hashing import BlockHash


def type_name(value: object) -> str:
    """``int``, ``numpy.int64``: the name of the value's type, for error messages."""
    cls = type(value)
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def got(value: object) -> str:
    """``'3' (str)``: a value as an error message names it."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type_name(value)})"


def request_id(value: object) -> str:
    if not isinstance(value, str):
        raise PoolMisuseError(f"a request id is a str, got {got(value)}")
    return value


def integer(name: str, value: object) -> int:
    """``value`` as an int: an int as it is, anything else with ``__index__`` (numpy
    integers) converted; ``bool``, ``float`` and the rest are refused."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise PoolMisuseError(
            f"{name} must be an int (or an integer with __index__, such as numpy.int64), "
            f"got {got(value)}"
        )
    try:
        return operator.index(cast(SupportsIndex, value))
    except Exception as exc:  # a broken __index__ (it raised, or returned no int)
        raise PoolMisuseError(f"{name}: int({got(value)}) failed: {exc!r}") from None


def count(name: str, value: object) -> int:
    """A non-negative int (see :func:`integer`; ``bool`` is refused: ``True`` is not a
    count)."""
    if type(value) is not int:
        value = integer(name, value)
    if value < 0:
        raise PoolMisuseError(f"{name} must be >= 0, got {value}")
    return value


def block_id(value: object, num_blocks: int) -> int:
    """A block id of a pool of ``num_blocks`` blocks, as an int; else
    :class:`~kvguard.errors.UnknownBlockError` naming what it got."""
    if type(value) is not int:
        if isinstance(value, bool) or not hasattr(type(value), "__index__"):
            raise UnknownBlockError(
                f"a block id is an int in 0..{num_blocks - 1}, got {got(value)}"
            )
        value = integer("a block id", value)
    if not 0 <= value < num_blocks:
        raise UnknownBlockError(
            f"block id {value} is outside this pool: its ids are 0..{num_blocks - 1}"
        )
    return value


def block_ids(values: list[Any], num_blocks: int) -> list[int]:
    """A new list of ``values`` checked and converted by :func:`block_id` (the slow
    path: after a primitive refused an id that is not an int in range)."""
    return [block_id(value, num_blocks) for value in values]


def flag(name: str, value: object) -> bool:
    if value is not True and value is not False:
        raise PoolMisuseError(f"{name} must be True or False, got {got(value)}")
    return value


def tier(value: object) -> str:
    if not isinstance(value, str):
        raise PoolMisuseError(f"a tier name is a str, got {got(value)}")
    return value


def block_hash(name: str, value: object) -> BlockHash:
    if not isinstance(value, bytes):
        raise PoolMisuseError(f"{name} must be a block hash (bytes), got {got(value)}")
    return value  # type: ignore[return-value]


def _listed(name: str, values: object) -> list[Any]:
    """``values`` as a list; one bare id or hash (or a str/bytes, iterable as its
    items) is refused, not iterated."""
    if type(values) is list:
        return values
    if type(values) is tuple:  # (no ABC checks on the common path)
        return list(values)
    if isinstance(values, (str, bytes, bytearray, Mapping)) or not isinstance(values, Iterable):
        raise PoolMisuseError(
            f"{name} must be a list (or another iterable), got {got(values)}; "
            "wrap a single item in a list"
        )
    try:
        return list(values)
    except Exception as exc:  # an iterable whose iteration fails
        raise PoolMisuseError(f"{name}: list({got(values)}) failed: {exc!r}") from None


def id_list(values: object) -> list[int]:
    """Block ids as a list. Each id is checked where it is used (the pool's hot paths
    check ``type(id) is int`` and the range in the same pass; :func:`block_ids`
    converts integer-likes)."""
    return _listed("block_ids", values)


_INT64 = range(-(1 << 63), 1 << 63)


def seals(values: object) -> dict[int, int]:
    """``validate_blocks``' ``seals``: a mapping of block id (int) to seal (an int64).
    A plain dict of plain ints in range (a step's seals, every step) is checked with
    C-level passes and used as it is."""
    if type(values) is dict:
        found = values.values()
        if (
            _INT_ONLY.issuperset(map(type, values))
            and _INT_ONLY.issuperset(map(type, found))
            and (not values or (min(found) >= _INT64.start and max(found) < _INT64.stop))
        ):
            return values
    if not isinstance(values, Mapping):
        raise PoolMisuseError(f"seals must be a dict of block id -> seal, got {got(values)}")
    out: dict[int, int] = {}
    for key, value in values.items():
        if type(key) is not int or isinstance(key, bool):
            raise PoolMisuseError(f"seals is keyed by block id (int), got {got(key)}")
        if type(value) is not int or value not in _INT64:
            raise PoolMisuseError(f"block {key}: a seal is an int in int64 range, got {got(value)}")
        out[key] = value
    return out


_BYTES = frozenset({bytes})
_INT_ONLY = frozenset({int})


def hash_list(name: str, values: object) -> list[BlockHash]:
    hashes = _listed(name, values)
    if not _BYTES.issuperset(map(type, hashes)):  # (one C-level pass for plain bytes)
        for value in hashes:
            if not isinstance(value, bytes):
                raise PoolMisuseError(f"{name} must hold block hashes (bytes), got {got(value)}")
    return hashes


def token_array(values: object) -> array[int]:
    """Token ids as a compact int64 array; bad ids fail here, not mid-publication."""
    if type(values) is not list and type(values) is not tuple:  # (the common path: no ABCs)
        if isinstance(values, (str, bytes, bytearray, Mapping)) or not isinstance(values, Iterable):
            raise PoolMisuseError(f"token_ids must be a sequence of ints, got {got(values)}")
        if isinstance(values, array) and values.typecode != "q":
            values = values.tolist()
    try:
        return array("q", values)  # (takes integer-likes: it calls __index__)
    except (TypeError, OverflowError, ValueError) as exc:
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
            f"owner: str), got {got(value)}"
        )
    return value


def publications(values: object) -> Mapping[int, PendingPublication] | None:
    """``validate_blocks``' ``publish``: None, or a mapping of id to publication (every
    entry checked, also those for ids the call does not validate). Keys that are
    integer-likes but not ints come back converted, in a new dict."""
    if values is None:
        return None
    if not isinstance(values, Mapping):
        raise PoolMisuseError(
            f"publish must be a dict of block id -> publication, got {got(values)}"
        )
    converted = False
    for key, value in values.items():
        if type(key) is not int:
            integer_key(key)
            converted = True
        if not (  # publication()'s test, inlined: this runs once per block of a step
            type(value) is tuple
            and len(value) == 3
            and isinstance(value[0], bytes)
            and (value[1] is None or isinstance(value[1], bytes))
            and isinstance(value[2], str)
        ):
            publication(key, value)  # raises, naming the block
    if not converted:
        return values
    out: dict[int, PendingPublication] = {}
    for key, value in values.items():
        key = integer_key(key)
        if key in out:
            raise PoolMisuseError(f"publish names block {key} twice; give each block once")
        out[key] = value
    return out


def integer_key(value: object) -> int:
    """A key of ``publish``: a block id, as an int (not range-checked: entries for ids
    a call does not validate are ignored)."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise PoolMisuseError(f"publish is keyed by block id (int), got {got(value)}")
    return integer("a key of publish", value)
