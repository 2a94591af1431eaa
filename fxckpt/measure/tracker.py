"""LiveTensorTracker: the bytes of tensor storages a step holds, counted at the dispatcher.

One of the two memory measures of :mod:`fxckpt.measure` (the other is the RSS protocol), and
what verification (:mod:`fxckpt.measure.verify`) runs on fake tensors.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveTensorTracker", "Scratch"]

Scratch = Callable[[Any, tuple, dict], int]
"""``scratch(func, args, kwargs)``: bytes the kernel of an aten call allocates for itself."""


class LiveTensorTracker(TorchDispatchMode):
    """Count the bytes of tensor storages created by ops while active, and their peak, per device.

    A storage is counted once, when an op first returns it, and uncounted when it is freed (even
    after the tracker has exited). Storages that existed before entering (parameters, inputs,
    gradients being accumulated into) are never counted, with no list to keep: an op output
    that shares a storage with one of the op's inputs is a view or an in-place result, not an
    allocation, so only storages an op allocates while the tracker is active count.

        with LiveTensorTracker() as t:
            loss = model(x).sum(); loss.backward()
        t.peak_bytes   # most bytes alive at once during the step, beyond what existed before

    ``scratch(func, args, kwargs)`` adds what a kernel allocates for itself while it runs to what
    is alive at that moment (:func:`fxckpt.cost.scratch.call_scratch`), for the peaks only.
    ``fake=True`` counts fake tensors' (meta) storages too: inside a ``FakeTensorMode`` it tells
    what a step *would* hold, holding nothing (:mod:`fxckpt.measure.verify`).
    """

    def __init__(self, *, fake: bool = False, scratch: Optional[Scratch] = None,
                 size: Callable[[Any], int] = int) -> None:
        super().__init__()
        self._fake = fake
        self._scratch = scratch
        self._size = size
        """A storage's byte count as an int (fake tensors of data-dependent size: an estimate)."""
        self._lock = threading.RLock()
        self._live: dict[int, tuple[str, int]] = {}
        self._current: dict[str, int] = {}
        self._peak: dict[str, int] = {}
        self._peak_total = 0
        self.allocated_bytes = 0
        """Bytes of all storages counted since entering, freed or not (work done, not memory held).
        """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Dynamo compiles under the tracker (it is off while Dynamo traces and fxckpt plans),
        which then counts what the compiled graphs run: a step through Dynamo is measured as
        it runs, planned."""
        return True

    @property
    def current_bytes(self) -> int:
        """Bytes of counted storages alive now, over all devices."""
        return sum(self._current.values())

    @property
    def peak_bytes(self) -> int:
        """Most bytes alive at once since entering or the last :meth:`reset_peak`, over all
        devices."""
        return self._peak_total

    @property
    def current_bytes_by_device(self) -> dict[str, int]:
        return dict(self._current)

    @property
    def peak_bytes_by_device(self) -> dict[str, int]:
        """The peak of each device on its own (the devices may peak at different times)."""
        return dict(self._peak)

    def reset_peak(self) -> None:
        """Make the peaks equal to what is alive now."""
        with self._lock:
            self._peak = dict(self._current)
            self._peak_total = self.current_bytes

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Optional[dict[str, Any]] = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        seen = {id(_storage_of(t, self._fake)) for t in _tensor_leaves((args, kwargs))}
        for t in _tensor_leaves(out):
            storage = _storage_of(t, self._fake)
            if storage is not None and id(storage) not in seen:
                self._count(storage, str(t.device))
        if self._scratch is not None:
            self._during(func, args, kwargs)
        return out

    def _during(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise the peaks to what was alive while ``func`` ran, its own scratch included."""
        assert self._scratch is not None
        extra = self._scratch(func, args, kwargs)
        if not extra:
            return
        tensors = _tensor_leaves(args)
        if not tensors:
            return
        device = str(tensors[0].device)
        with self._lock:
            self._peak[device] = max(self._peak.get(device, 0),
                                     self._current.get(device, 0) + extra)
            self._peak_total = max(self._peak_total, self.current_bytes + extra)

    def _count(self, storage: torch.UntypedStorage, device: str) -> None:
        key, nbytes = id(storage), self._size(storage.nbytes())
        with self._lock:
            if key in self._live:
                return
            self._live[key] = (device, nbytes)
            self.allocated_bytes += nbytes
            self._current[device] = self._current.get(device, 0) + nbytes
            self._peak[device] = max(self._peak.get(device, 0), self._current[device])
            self._peak_total = max(self._peak_total, self.current_bytes)
        weakref.finalize(storage, self._freed, key).atexit = False

    def _freed(self, key: int) -> None:
        with self._lock:
            device, nbytes = self._live.pop(key)
            self._current[device] -= nbytes


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors of an aten call's arguments or outputs: tensors, lists, tuples and dicts of
    them (``pytree.tree_leaves`` reads the same ones, at a few times the cost per call)."""
    found: list[torch.Tensor] = []
    _collect(tree, found)
    return found


def _collect(tree: Any, found: list[torch.Tensor]) -> None:
    if isinstance(tree, torch.Tensor):
        found.append(tree)
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            _collect(x, found)
    elif isinstance(tree, dict):
        for x in tree.values():
            _collect(x, found)
    elif not isinstance(tree, _SCALARS):
        found.extend(x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor))


_SCALARS = (int, float, bool, str, type(None), torch.SymInt, torch.SymFloat, torch.SymBool,
            torch.dtype, torch.device, torch.layout, torch.memory_format)


def _storage_of(t: torch.Tensor, fake: bool = False) -> Optional[torch.UntypedStorage]:
    """The storage holding ``t``'s memory; ``None`` without one, and for meta unless ``fake``."""
    if t.layout != torch.strided:
        return None
    try:
        storage = t.untyped_storage()
    except (
        RuntimeError,
        NotImplementedError,
    ):  # wrapper subclasses without a storage of their own
        return None
    return None if storage.device.type == "meta" and not fake else storage
