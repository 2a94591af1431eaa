"""Guards: the Python facts a captured graph depends on, recorded at capture, checked every call.

A capture runs the model's forward once and keeps its tensor operations. Everything Python
decided on the way is frozen into the graph: which child module was called, that
``self.temperature`` was 0.5, that ``self.use_noise`` was True, which generator drew the noise.
``torch.compile`` answers this with guards; so does fxckpt:

* **structure**: every child module, parameter and buffer under the model, by identity (a new
  head, a replaced layer, a re-created parameter);
* **attributes read**: every attribute the forward read from a module's ``__dict__`` while it
  was captured, by value for plain values (numbers, strings, enums, dtypes, tuples of them) and
  by identity for objects (tensors kept as plain attributes, functions, generators); a plain
  object read there (a ``config``) is guarded by identity and by the plain values it holds;
* the mode of every module, hooks, the autocast state and the call's structure are the
  dispatcher's key (:class:`~fxckpt.signature.CallKey`), checked before any guard.

:func:`~fxckpt.capture.reads.recording` records the reads while a capture runs, on this thread
only. :meth:`Guards.failure` then says, before each call, which fact no longer holds; the
dispatcher captures again (see :mod:`fxckpt.serve.dispatch`).

    guards = build_guards(live_root, reads)
    guards.failure()  ->  None | Failure("attributes of <root>: `temperature`", "was 0.5, now 2.0")

The check costs about a microsecond per module (measured in the bench: ``guard overhead``).
What is *not* guarded: module-level globals and closures the forward reads, and attributes of
objects other than modules and the plain objects they hold.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import operator
import types
from typing import Any, Optional

import torch

from fxckpt.errors import CaptureError
from fxckpt.capture.generators import describe, generator_types
from fxckpt.capture.reads import MISSING, MUTABLE, Reads, is_plain

__all__ = ["Guards", "Failure", "build_guards"]

_MISSING = MISSING
_MISSINGS = itertools.repeat(MISSING)
_IDENTITY: tuple[type, ...] = (
    torch.Tensor, torch.Generator, torch.nn.Module, types.FunctionType, types.BuiltinFunctionType,
    types.MethodType, types.ModuleType, type,
)


# -- guards --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Failure:
    """A fact that no longer holds."""

    fact: str
    """Which fact: ``attributes of blocks.0: `scale```, ``the children of <root>``."""
    detail: str
    """What changed, with the values: ``was 0.5, now 2.0``."""
    structural: bool
    """A child, parameter or buffer was replaced: the old graph can never serve again."""

    def __str__(self) -> str:
        return f"{self.fact} changed ({self.detail})"


@dataclasses.dataclass(frozen=True)
class _DictGuard:
    """Facts about one ``__dict__`` (a module's, a plain object's, or a module's
    ``_modules`` / ``_parameters`` / ``_buffers``)."""

    where: str
    d: dict
    same: tuple[str, ...] = ()
    """Names whose values must be the same objects."""
    same_values: tuple[Any, ...] = ()
    equal: tuple[str, ...] = ()
    """Names whose values must be equal plain values of the same types."""
    equal_values: tuple[Any, ...] = ()
    equal_types: tuple[type, ...] = ()
    absent: tuple[str, ...] = ()
    """Names that must stay absent (class attributes the forward read)."""
    length: Optional[int] = None
    """For containers of children, parameters and buffers: how many entries."""

    def failure(self) -> Optional[Failure]:
        d = self.d
        structural = self.length is not None
        if structural and len(d) != self.length:
            return Failure(self.where, f"{self.length} entries, now {len(d)}", True)
        if self.same:
            now = [d.get(k, _MISSING) for k in self.same]
            if not all(map(operator.is_, now, self.same_values)):
                name = next(k for k, a, b in zip(self.same, now, self.same_values) if a is not b)
                what = f"{name!r} is another object" if structural else "another object"
                return Failure(self.where if structural else f"{self.where}: `{name}`", what,
                               structural)
        if self.equal:
            now = [d.get(k, _MISSING) for k in self.equal]
            if now != list(self.equal_values) or tuple(map(type, now)) != self.equal_types \
                    or not all(map(_same_sign, now, self.equal_values)):
                for k, a, b in zip(self.equal, now, self.equal_values):
                    if a is not b and (type(a) is not type(b) or a != b or not _same_sign(a, b)):
                        return Failure(f"{self.where}: `{k}`",
                                       f"was {_short(b)}, now {_short(a)}", False)
        for name in self.absent:
            if name in d:
                return Failure(f"{self.where}: `{name}`", "set on the instance, over the "
                               "class attribute the forward read", False)
        return None


def _same_sign(a: Any, b: Any) -> bool:
    """-0.0 and 0.0 are equal but not the same value (``x / a`` differs)."""
    return not (type(a) is float and a == 0.0) or str(a) == str(b)


@dataclasses.dataclass(frozen=True)
class Guards:
    """The facts a captured graph depends on (see the module docstring).

    :meth:`failure` first checks every fact at once with C-level ``map`` calls over flat tables
    (a few tens of nanoseconds a fact); only when one fails does it look for which, dict by dict.
    """

    checks: tuple[_DictGuard, ...] = ()

    def __post_init__(self) -> None:
        sized = [c for c in self.checks if c.length is not None]
        same = [(c.d, k, v) for c in self.checks for k, v in zip(c.same, c.same_values)]
        equal = [(c.d, k, v, t) for c in self.checks
                 for k, v, t in zip(c.equal, c.equal_values, c.equal_types)]
        absent = [(c.d, k) for c in self.checks for k in c.absent]
        flat = {
            "_sized": tuple(c.d for c in sized), "_lengths": tuple(c.length for c in sized),
            "_same": tuple(zip(*same)) or ((), (), ()),
            "_equal": tuple(zip(*equal)) or ((), (), (), ()),
            "_zeros": tuple((d, k, str(v)) for d, k, v, _ in equal
                            if type(v) is float and v == 0.0),
            "_absent": tuple(zip(*absent)) or ((), ()),
        }
        for name, value in flat.items():
            object.__setattr__(self, name, value)

    def _holds(self) -> bool:
        dicts, keys, values = self._same  # type: ignore[attr-defined]
        if tuple(map(len, self._sized)) != self._lengths:  # type: ignore[attr-defined]
            return False
        if not all(map(operator.is_, map(dict.get, dicts, keys, _MISSINGS), values)):
            return False
        dicts, keys, values, types = self._equal  # type: ignore[attr-defined]
        now = list(map(dict.get, dicts, keys, _MISSINGS))
        if now != list(values) or tuple(map(type, now)) != types:
            return False
        if any(str(d.get(k)) != sign for d, k, sign in self._zeros):  # type: ignore[attr-defined]
            return False
        return not any(map(dict.__contains__, *self._absent))  # type: ignore[attr-defined]

    def failure(self) -> Optional[Failure]:
        """The first fact that no longer holds; ``None`` when all hold."""
        if self._holds():
            return None
        for check in self.checks:
            why = check.failure()
            if why is not None:
                return why
        return None

    def __len__(self) -> int:
        return len(self.checks)


def build_guards(live: torch.nn.Module, reads: Optional[Reads] = None,
                 aliases: Optional[dict[int, torch.nn.Module]] = None) -> Guards:
    """Guards for a graph captured from ``live`` (its structure and, with ``reads``, what the
    forward read). ``aliases`` maps the id of an object the capture ran on (a view of the root)
    to the live module whose state it viewed."""
    paths = {id(m): (p or "<root>") for p, m in live.named_modules(remove_duplicate=False)}
    checks: list[_DictGuard] = []
    for m in {id(m): m for m in live.modules()}.values():
        where = paths[id(m)]
        for kind in ("_modules", "_parameters", "_buffers"):
            table = m.__dict__[kind]
            label = {"_modules": "children", "_parameters": "parameters",
                     "_buffers": "buffers"}[kind]
            checks.append(_DictGuard(f"the {label} of {where}", table, tuple(table),
                                     tuple(table.values()), length=len(table)))
    if reads is not None:
        seen: set[int] = set()
        for obj, values, absent in reads.objects.values():
            obj = (aliases or {}).get(id(obj), obj)
            where = paths.get(id(obj), type(obj).__name__)
            checks.extend(_attribute_guards(obj, where, values, absent, seen))
    return Guards(tuple(checks))


HELD_DEPTH = 2
"""How deep plain objects held by the model are guarded (``config.text_config.hidden_size``)."""


def _attribute_guards(obj: Any, where: str, values: dict[str, Any], absent: set[str],
                      seen: set[int], depth: int = 0) -> list[_DictGuard]:
    """Guards on ``obj``'s ``values`` (what was read of it), and on the plain objects among them
    (a ``config``: every plain value it holds, and the plain objects it holds in turn)."""
    same: dict[str, Any] = {}
    equal: dict[str, Any] = {}
    held: list[_DictGuard] = []
    for name, value in values.items():
        if is_plain(value):
            # a copy: a list the model changes in place must not change what is expected too
            equal[name] = copy.deepcopy(value) if isinstance(value, MUTABLE) else value
            continue
        _refuse_foreign_generator(where, name, value)
        same[name] = value
        if _is_plain_object(value) and id(value) not in seen and depth < HELD_DEPTH:
            seen.add(id(value))
            inner = {k: v for k, v in vars(value).items()
                     if is_plain(v) or _is_plain_object(v)}
            held += _attribute_guards(value, f"{where}.{name}", inner, set(), seen, depth + 1)
    own = _DictGuard(
        f"attributes of {where}" if depth == 0 else where,
        object.__getattribute__(obj, "__dict__"), tuple(same), tuple(same.values()),
        tuple(equal), tuple(equal.values()), tuple(map(type, equal.values())),
        tuple(sorted(absent)),
    )
    return [own, *held]


def _is_plain_object(value: Any) -> bool:
    """A configuration-like object: its own ``__dict__``, not a tensor, module or function."""
    return (hasattr(value, "__dict__") and not isinstance(value, _IDENTITY)
            and not callable(value) and not isinstance(value, MUTABLE))


def _refuse_foreign_generator(where: str, name: str, value: Any) -> None:
    if isinstance(value, generator_types()):
        raise CaptureError(
            f"{describe(f'{where}.{name}', value)}; numbers drawn from it while the "
            "model is captured would be replayed as constants on every call. Draw random "
            "numbers with torch (torch.rand, torch.randn(..., generator=g) with a "
            "torch.Generator), which fxckpt replays exactly, or draw them outside the model "
            "and pass them in"
        )


def _short(value: Any) -> str:
    if value is _MISSING:
        return "nothing"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."

