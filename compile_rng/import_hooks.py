"""Post-import hooks: run a callback with a module once its import has completed (at once
if it already has). The installer uses them to change DTensor only when a program
imports it: ``import compile_rng`` imports no DTensor."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType

_pending: dict[str, list[Callable[[ModuleType], None]]] = {}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs the callbacks :func:`after_import` registered for a module once its import
    has completed (the module object is the one in ``sys.modules``)."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _pending:
            return None
        sys.meta_path.remove(self)  # find the real spec without recursing into this finder
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader

        class _ThenCallbacks(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                module.__spec__.loader = module.__loader__ = loader
                loader.exec_module(module)
                for callback in _pending.pop(fullname, []):
                    callback(module)

        spec.loader = _ThenCallbacks()
        return spec


_FINDER = _AfterImport()


def after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """``callback(module)`` now if ``name`` is imported, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    callbacks = _pending.setdefault(name, [])
    if callback not in callbacks:
        callbacks.append(callback)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def cancel_pending() -> None:
    """Drop every callback whose module has not been imported yet."""
    _pending.clear()
