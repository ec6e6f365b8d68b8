"""A vendored vLLM test's strict expected failure under kvguard's guard, checked by its
exception *and* its message.

pytest's ``xfail(raises=...)`` checks the type only, and the types vLLM's tests fail
with under the guard (``AssertionError``, ``KeyError``, ``TypeError``...) are ones a bug
could raise too. So each expected failure names the message it fails with (a regex
``re.search`` finds in ``str(exc)``: vLLM's assertion as pytest rewrites it, or the
error's text), and :func:`expect` makes anything else a real failure that names both:
another type, another message, or a kvguard error where vLLM's type is expected --
kvguard's checks raise its own types (:mod:`kvguard.errors`), some of which also derive
from a builtin vLLM code catches (``UnknownRequestError`` is a ``KeyError``,
``PartialEntryError`` an ``AssertionError``). A :class:`~kvguard.errors.CorruptionError`
(kvguard found its own bookkeeping broken) never passes as expected.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kvguard.errors import CorruptionError, KvGuardError

_Types = type[BaseException] | tuple[type[BaseException], ...]


class UnexpectedFailure(Exception):
    """A test marked as an expected failure failed otherwise (its message names both)."""


@dataclass(frozen=True, slots=True)
class ExpectedFailure:
    """How a vendored test fails under the guard, by design."""

    raises: _Types
    """The exception it fails with."""
    match: str
    """A regex ``re.search`` finds in the exception's message."""
    reason: str
    """Why it fails there (the xfail's reason)."""

    def __post_init__(self) -> None:
        re.compile(self.match)  # (a bad pattern fails at collection, not in the test)
        if issubclass(UnexpectedFailure, self.raises):
            raise ValueError(f"{self.raises!r} would let any failure pass as expected")

    def mismatch(self, exc: BaseException) -> str | None:
        """Why ``exc`` is not this failure (None: it is)."""
        if not isinstance(exc, self.raises):
            return "another exception"
        if isinstance(exc, CorruptionError):
            return "kvguard found its own bookkeeping broken, which is never expected"
        types = self.raises if isinstance(self.raises, tuple) else (self.raises,)
        if isinstance(exc, KvGuardError) and not any(issubclass(t, KvGuardError) for t in types):
            return "a kvguard error, where vLLM's exception is expected"
        if re.search(self.match, str(exc)) is None:
            return "another message"
        return None

    def describe(self) -> str:
        types = self.raises if isinstance(self.raises, tuple) else (self.raises,)
        names = " or ".join(t.__name__ for t in types)
        return f"{names} matching {self.match!r}"


def expect(expected: ExpectedFailure, call: Callable[[], object]) -> Callable[[], None]:
    """``call`` (a test item's setup or run), where a failure other than ``expected``
    raises :class:`UnexpectedFailure` (chained to it), which no xfail accepts."""

    def checked() -> None:
        try:
            call()
        except (Exception, pytest.fail.Exception) as exc:  # (not skips, nor Ctrl-C)
            why = expected.mismatch(exc)
            if why is None:
                raise
            raise UnexpectedFailure(
                f"expected {expected.describe()}; got {type(exc).__module__}."
                f"{type(exc).__qualname__}: {exc} ({why})"
            ) from exc

    return checked


def mark(item: pytest.Item, expected: ExpectedFailure) -> None:
    """``item`` is a strict expected failure: ``expected``, and nothing else."""
    item.add_marker(pytest.mark.xfail(reason=expected.reason, raises=expected.raises, strict=True))
    # (The instance's own attributes, in front of its class's methods.)
    item.setup = expect(expected, item.setup)  # type: ignore[method-assign]
    item.runtest = expect(expected, item.runtest)  # type: ignore[method-assign]
