"""What the forward read and wrote while it was captured: the raw record guards are built from.

:func:`recording` gives each module of the model, for the duration of a capture, a subclass of
its own class whose ``__getattribute__`` and ``__setattr__`` note what the forward reads from and
writes to the instance's ``__dict__``, on the capturing thread only (instances, not classes,
change; nothing process-wide is patched). :mod:`fxckpt.capture.guards` turns the reads into the
checks made before every call; capture uses the writes to see attributes the forward changed
that ``torch.export`` put back by itself.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from typing import Any, Callable, Iterator, Optional

import torch
import torch.fx
from torch._subclasses.fake_tensor import is_fake

__all__ = ["Reads", "recording", "is_plain", "PLAIN", "MUTABLE", "MISSING"]

MISSING = object()
"""Stands for an attribute that is not there."""
_MODULE_KEYS = frozenset(torch.nn.Module().__dict__) | {
    "_compiled_call_impl", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
    "_forward_pre_hooks_with_kwargs", "_is_full_backward_hook",
}
"""nn.Module's own bookkeeping (``training`` is in the call key; the rest is not the model's)."""

PLAIN: tuple[type, ...] = (
    type(None), bool, int, float, complex, str, bytes, type(Ellipsis), range, slice,
    torch.dtype, torch.device, torch.layout, torch.memory_format, enum.Enum,
)
"""Values compared by equality."""

MUTABLE = (list, dict, set)


def is_plain(value: Any) -> bool:
    """A value compared by equality: plain values and containers of them (torch.export hands
    back copies of list attributes, so a list is guarded by what it holds, not its identity)."""
    if isinstance(value, PLAIN):
        return True
    if type(value) in (tuple, frozenset, list, set) or isinstance(value, torch.Size):
        return all(is_plain(v) for v in value)
    if type(value) is dict:
        return all(is_plain(k) and is_plain(v) for k, v in value.items())
    return False


class Reads:
    """What the forward read while captured: per object, attribute name -> value first seen."""

    def __init__(self) -> None:
        self.objects: dict[int, tuple[Any, dict[str, Any], set[str]]] = {}
        self.written: dict[tuple[int, str], tuple[Any, str, Any, Any]] = {}
        """``(object, name, value before, value set last)`` of attributes the forward set that
        it had before: torch.export puts such attributes back itself, so only this record
        shows them."""

    def note_write(self, obj: Any, name: str, value: Any) -> None:
        d = object.__getattribute__(obj, "__dict__")
        key = (id(obj), name)
        if key in self.written:
            self.written[key] = self.written[key][:3] + (value,)
        elif name in d:
            self.written[key] = (obj, name, d[name], value)

    def changed(self) -> list[tuple[Any, str, Any, Any]]:
        """``(object, name, before, set)`` of attributes the forward changed (not just set to
        the value they had)."""
        return [(obj, name, before, now) for obj, name, before, now in self.written.values()
                if now is not before and not (is_plain(now) and type(now) is type(before)
                                              and now == before)]

    def note(self, obj: Any, name: str, value: Any) -> None:
        if isinstance(value, torch.fx.Proxy) or (isinstance(value, torch.Tensor)
                                                   and is_fake(value)):
            return  # a value the capture itself made (an attribute the forward assigned)
        entry = self.objects.get(id(obj))
        if entry is None:
            entry = self.objects[id(obj)] = (obj, {}, set())
        d = object.__getattribute__(obj, "__dict__")
        if name in d:
            if d[name] is value:
                entry[1].setdefault(name, value)
        elif isinstance(value, PLAIN) and _class_value(obj, name) is value:
            entry[2].add(name)  # a class attribute: an instance attribute would shadow it


    def of_type(self, kind: type) -> list[str]:
        """``Class.name`` of each attribute read whose value is a ``kind``."""
        return [f"{type(obj).__name__}.{name}" for obj, values, _ in self.objects.values()
                for name, value in values.items() if isinstance(value, kind)]

    def forget(self, obj: Any, name: str) -> None:
        """Drop a read of an attribute the forward assigned itself (not a fact it depends on)."""
        entry = self.objects.get(id(obj))
        if entry is not None:
            entry[1].pop(name, None)
            entry[2].discard(name)


def _class_value(obj: Any, name: str) -> Any:
    for klass in type(obj).__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return MISSING


_local = threading.local()
_SUBCLASSES: dict[type, type] = {}
_lock = threading.Lock()


def _recording_class(cls: type) -> Optional[type]:
    """``cls`` with a ``__getattribute__`` that notes reads (made once per class)."""
    with _lock:
        sub = _SUBCLASSES.get(cls)
        if sub is None:
            base: Callable[[Any, str], Any] = cls.__getattribute__  # type: ignore[assignment]

            def __getattribute__(self: Any, name: str) -> Any:
                value = base(self, name)
                reads = getattr(_local, "reads", None)
                if reads is not None and name[:2] != "__" and name not in _MODULE_KEYS:
                    reads.note(self, name, value)
                return value

            set_base: Callable[[Any, str, Any], None] = cls.__setattr__  # type: ignore[assignment]

            def __setattr__(self: Any, name: str, value: Any) -> None:
                reads = getattr(_local, "reads", None)
                if reads is not None and name[:2] != "__" and name not in _MODULE_KEYS:
                    reads.note_write(self, name, value)
                set_base(self, name, value)

            try:
                sub = type(cls)(cls.__name__, (cls,), {
                    "__getattribute__": __getattribute__, "__setattr__": __setattr__,
                    "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__, "__slots__": (),
                    "fxckpt_recording": True,
                })
            except Exception:  # a class that cannot be subclassed: its reads go unrecorded
                return None
            _SUBCLASSES[cls] = sub
        return sub


@contextlib.contextmanager
def recording(modules: list[torch.nn.Module]) -> Iterator[Reads]:
    """Record, on this thread, the attributes read from ``modules`` while the block runs."""
    reads = Reads()
    swapped: list[tuple[torch.nn.Module, type]] = []
    for m in dict.fromkeys(modules):
        cls = type(m)
        if cls.__dict__.get("fxckpt_recording"):
            continue  # nested: already recording
        sub = _recording_class(cls)
        if sub is None:
            continue
        try:
            m.__class__ = sub
        except TypeError:  # an incompatible layout: this module's reads go unrecorded
            continue
        swapped.append((m, cls))
    outer = getattr(_local, "reads", None)
    _local.reads = reads
    try:
        yield reads
    finally:
        _local.reads = outer
        for m, cls in swapped:
            m.__class__ = cls
