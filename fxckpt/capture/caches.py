"""Result caches the model's code keeps, emptied of what a capture or a measuring run put there.

Model code memoises tensors it builds from constants: Hugging Face's BEiT builds its relative
position index once per window size (``functools.lru_cache`` behind a static method), other code
keeps rotary tables or masks in a module-level ``@lru_cache`` function. When fxckpt runs the
forward on fake tensors (to measure the unmodified step, or under ``torch.export``), such a
function returns a *fake* tensor and the cache keeps it: every later call of that model, and of
any other instance of its class, then computes with it and returns fake outputs.

:func:`caches_kept` finds the ``functools`` caches reachable from the model's classes (their
methods, static and class methods and properties, what those wrap or close over) and from the
globals of the Python modules that define them, and empties each one that missed while it was
active (a miss is a new entry). Emptying loses nothing but time: the next call fills it again.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any, Iterator

import torch

__all__ = ["caches_kept", "lru_caches"]

DEPTH = 3
"""How many wrappers deep a cache is looked for (a static method wrapping a decorator's wrapper
that closes over the ``lru_cache`` object is 3)."""


def _is_cache(value: Any) -> bool:
    return callable(getattr(value, "cache_info", None)) and callable(
        getattr(value, "cache_clear", None))


def lru_caches(model: torch.nn.Module) -> list[Any]:
    """The ``functools`` caches the classes of ``model``'s modules can reach, once each."""
    found: dict[int, Any] = {}
    seen: set[int] = set()

    def visit(value: Any, depth: int) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        if _is_cache(value):
            found[id(value)] = value
        if depth == 0:
            return
        if isinstance(value, (staticmethod, classmethod)):
            visit(value.__func__, depth - 1)
        elif isinstance(value, property):
            for part in (value.fget, value.fset):
                if part is not None:
                    visit(part, depth - 1)
        elif isinstance(value, types.FunctionType) or _is_cache(value):
            wrapped = getattr(value, "__wrapped__", None)
            if wrapped is not None:
                visit(wrapped, depth - 1)
            for cell in getattr(value, "__closure__", None) or ():
                try:
                    inner = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if isinstance(inner, types.FunctionType) or _is_cache(inner):
                    visit(inner, depth - 1)

    classes = {cls for m in model.modules() for cls in type(m).__mro__
               if cls.__module__.split(".")[0] not in ("torch", "builtins")}
    modules = {cls.__module__ for cls in classes}
    for cls in classes:
        for value in vars(cls).values():
            visit(value, DEPTH)
    for name in modules:
        module = sys.modules.get(name)
        for value in vars(module).values() if module is not None else ():
            if isinstance(value, types.FunctionType) or _is_cache(value):
                visit(value, DEPTH)  # what it imported too: a mask helper from a utility module
    return list(found.values())


@contextlib.contextmanager
def caches_kept(model: torch.nn.Module) -> Iterator[None]:
    """Empty, on exit, every cache of :func:`lru_caches` that gained an entry meanwhile."""
    caches = [(c, c.cache_info().misses) for c in lru_caches(model)]
    try:
        yield
    finally:
        for cache, misses in caches:
            if cache.cache_info().misses != misses:
                cache.cache_clear()
