"""Random generators a model holds outside torch: Python's ``random.Random`` and numpy's
``Generator`` and ``RandomState``.

Users keep them as a module attribute (``self.rng = np.random.default_rng(0)``), in a list,
tuple or dict attribute (``self.rngs["mask"]``), or on a helper object a module holds (an
augmentation callable with its own ``self.rng``). Two things follow:

* a forward run only to capture or to measure the model must leave them as they were:
  :class:`~fxckpt.capture.traceless.Traceless` puts their states back;
* a capture whose forward drew from one would replay that one draw on every call, so the state
  guard reports the draw and capture refuses it by name.

``torch.Generator`` is not among them: fake tensors never advance it, and symbolic_trace replays
its draws exactly.
"""

from __future__ import annotations

import copy
import itertools
import random
import sys
import types
from typing import Any

import torch

__all__ = ["generator_types", "held_generators", "state_of", "set_state", "same_state",
           "describe"]

DEPTH = 2
"""How far below a module attribute generators are looked for (``self.aug.rngs[0]``)."""
ITEMS = 64
"""How many entries of a list, tuple or dict attribute are looked at (a vocabulary list is not
walked)."""
_SKIPPED = (torch.Tensor, torch.nn.Module, type, types.FunctionType, types.BuiltinFunctionType,
            types.MethodType, types.ModuleType, str, bytes)
_TORCH_TABLES = frozenset(vars(torch.nn.Module()))
"""A bare module's own entries (parameter, buffer, child and hook tables)."""


def generator_types() -> tuple[type, ...]:
    """``random.Random``, and numpy's ``Generator`` and ``RandomState`` when numpy is loaded."""
    numpy = sys.modules.get("numpy")
    found: tuple[type, ...] = (random.Random,)
    return found if numpy is None else (*found, numpy.random.Generator, numpy.random.RandomState)


def held_generators(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """``(path, generator)`` for each generator ``model``'s modules hold, once each, with a
    readable path: ``<root>.rng``, ``blocks.0.rngs['mask']``, ``<root>.jitter.rng``."""
    kinds = generator_types()
    found: dict[int, tuple[str, Any]] = {}
    seen: set[int] = set()

    def visit(value: Any, path: str, depth: int) -> None:
        if isinstance(value, kinds):
            found.setdefault(id(value), (path, value))
        elif depth == 0 or isinstance(value, _SKIPPED) or id(value) in seen:
            return
        elif isinstance(value, (list, tuple)):
            seen.add(id(value))
            for i, item in enumerate(value[:ITEMS]):
                visit(item, f"{path}[{i}]", depth - 1)
        elif isinstance(value, dict):
            seen.add(id(value))
            for key, item in itertools.islice(value.items(), ITEMS):
                visit(item, f"{path}[{key!r}]", depth - 1)
        else:
            try:
                attributes = vars(value)
            except TypeError:  # no __dict__: a number, a slotted or builtin object
                return
            seen.add(id(value))
            for key, item in itertools.islice(attributes.items(), ITEMS):
                visit(item, f"{path}.{key}", depth - 1)

    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if key not in _TORCH_TABLES:
                visit(value, f"{name or '<root>'}.{key}", DEPTH)
    return list(found.values())


def state_of(generator: Any) -> Any:
    """A copy of ``generator``'s state."""
    if isinstance(generator, random.Random):
        return generator.getstate()
    if hasattr(generator, "bit_generator"):  # numpy.random.Generator
        return copy.deepcopy(generator.bit_generator.state)
    return generator.get_state()  # numpy.random.RandomState


def set_state(generator: Any, state: Any) -> None:
    """Put back a state :func:`state_of` took."""
    if isinstance(generator, random.Random):
        generator.setstate(state)
    elif hasattr(generator, "bit_generator"):
        generator.bit_generator.state = state
    else:
        generator.set_state(state)


def same_state(a: Any, b: Any) -> bool:
    """Whether two states are equal (numpy arrays by value)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape") and hasattr(b, "shape"):  # numpy arrays
        numpy = sys.modules["numpy"]
        return bool(numpy.array_equal(a, b))
    return bool(a == b)


def describe(path: str, generator: Any) -> str:
    """``the forward reads `path`, a random.Random random generator``: the words capture's
    refusals use for a generator the model holds."""
    kind = type(generator)
    return f"the forward reads `{path}`, a {kind.__module__}.{kind.__qualname__} random generator"
