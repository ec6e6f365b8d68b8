"""The pure-torch ops, registered under vLLM's ``_C`` namespace (``torch.ops._C``).

Each op module declares its ops with :func:`op`, giving the schema copied verbatim from
vLLM 0.34.0's ``csrc/cpu/torch_bindings.cpp``: vLLM calls them through
``torch.ops._C.<name>`` (``vllm/_cpu_ops.py``), and a schema that drifts from the C++ one
fails loudly at the first call. Re-read that file at every vLLM upgrade.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Op:
    schema: str
    impl: Callable[..., Any]

    @property
    def name(self) -> str:
        return self.schema.split("(", 1)[0]


OPS: list[Op] = []
"""Every op the modules declared (filled as they are imported)."""

_library: torch.library.Library | None = None


def op(schema: str) -> Callable[[F], F]:
    """Declare ``fn`` as the implementation of ``schema``; registered by
    :func:`register_ops`. Python kernels get no schema defaults filled in by the
    dispatcher: ``fn`` must repeat them."""

    def declare(fn: F) -> F:
        OPS.append(Op(schema, fn))
        return fn

    return declare


def register_ops() -> None:
    """Define every op in ``torch.ops._C`` (idempotent; once per process).

    vLLM imports its op wrappers (``vllm/_cpu_ops.py``) only after calling the
    platform's ``import_kernels``, which calls this, and some of them test
    ``hasattr(torch.ops._C, ...)`` at import time: the ops exist before that."""
    global _library
    if _library is not None:
        return
    from . import attention, block_table, gumbel, input_batch, logit_bias, memory  # noqa: F401

    # FRAGMENT: adds to the namespace without claiming it. The registrations live as
    # long as this object, hence the module-level reference.
    library = torch.library.Library("_C", "FRAGMENT")  # type: ignore[no-untyped-call]
    for declared in OPS:
        library.define(declared.schema)  # type: ignore[no-untyped-call]
        # Composite: one kernel for every backend key, and for ops without tensor
        # arguments (no key to dispatch on), like vLLM's catch-all C++ kernels.
        library.impl(declared.name, declared.impl, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
    _library = library
