"""Patching vLLM's model runner modules from kvguard's plugin: at once for a module
already imported, else right after it is first executed (a post-import hook) -- workers
import their runner after vLLM loaded the plugins. Each concern's patches are one
:class:`RunnerPatches` (the NaN counting, the slot wipe, the KV audit, the block
zeroing: :mod:`.worker_nans`, :mod:`.worker_slots`, :mod:`.worker_audit`,
:mod:`.worker_zeroing`); several patch the same modules and methods, and compose.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any


class RunnerPatches:
    """One concern's patches of vLLM modules (module name -> patch), and whether they
    were installed in this process (the plugin's start-up checks ask)."""

    def __init__(self, patches: Mapping[str, Callable[[ModuleType], None]]) -> None:
        self.patches = patches
        self.applied = False

    def install(self) -> None:
        """Apply the patches: at once to a module already imported, else when it is.
        Idempotent."""
        patch_runners(self.patches)
        self.applied = True


def patch_runners(patches: Mapping[str, Callable[[ModuleType], None]]) -> None:
    """Apply each of ``patches`` (module name -> patch) to its module: now if it is
    imported, else on import. Idempotent per ``patches`` mapping (the patches themselves
    must be too: a module imported already is patched at every call)."""
    for name, patch in patches.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
    if not any(isinstance(f, PatchOnImport) and f.patches is patches for f in sys.meta_path):
        sys.meta_path.insert(0, PatchOnImport(patches))


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches a module right after it is first executed (a post-import hook).

    Several hooks may patch one module (the NaN counting here, the slot wipe of
    :mod:`kvguard.adapters.vllm.workers.slots`): the first hook on ``sys.meta_path`` that
    knows the module applies every hook's patch for it, in ``sys.meta_path`` order, and
    no hook asks another (which would recurse)."""

    def __init__(self, patches: Mapping[str, Callable[[ModuleType], None]]) -> None:
        self.patches = patches

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.patches:
            return None
        hooks = [f for f in sys.meta_path if isinstance(f, PatchOnImport)]
        patches = [f.patches[fullname] for f in hooks if fullname in f.patches]
        for finder in sys.meta_path:
            if isinstance(finder, PatchOnImport) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader, patches)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patches: list[Callable[[ModuleType], None]]) -> None:
        self.loader = loader
        self.patches = patches

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self.loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        for patch in self.patches:
            patch(module)

    def __getattr__(self, name: str) -> Any:  # get_code, get_source, is_package, ...
        return getattr(self.loader, name)


def mark_wrapper(patched: Any, stock: Any, mark: str) -> Any:
    """Make ``patched`` (wrapping ``stock``) tell itself apart and keep the way back:
    ``mark`` set, ``__wrapped__``, ``__doc__``, and the marks of the wrappers inside it
    -- so that each patch's "already applied?" check sees through the others' wrappers
    (several patches wrap one method: the NaN counting and the KV audit wrap V1's
    ``_bookkeeping_sync``, the slot wipe and the audit V2's ``update_requests``)."""
    patched.__dict__.update(getattr(stock, "__dict__", {}))
    setattr(patched, mark, True)
    patched.__wrapped__ = stock
    patched.__doc__ = stock.__doc__
    return patched
