"""What a run changes and must give back: tensor values, generators' states, autocast state.

The one place fxckpt reads and sets them (``tests/runtime/test_state.py`` holds every other module
to that), so that an exact recompute, a failed pipeline step, a capture or a measured step all
put state back the same way:

* **tensor values** (BatchNorm's running statistics, a step counter): :class:`TensorValues`
  copies them and puts the copies back in place (the tensors stay the model's objects);
  :func:`values_kept` does so around a block; :func:`copies` and :func:`put` are the two halves
  as plain functions, for code that ``torch.compile`` traces;
* **torch's global generators** (CPU, each initialised CUDA device): :func:`torch_states`,
  :func:`set_torch_states` and :func:`torch_random_kept`; **a model's own** ``torch.Generator``:
  :func:`generator_states` and :func:`set_generator_states`;
* **autocast**: :func:`autocast_state` (enabled and dtype per device, whether casts are cached)
  and :func:`autocast_kept`.

Threads. ``torch.random.fork_rng`` puts the generator back as it was when the block began. When
another Python thread (a data loader, an augmentation worker) draws from the same generator
meanwhile, that rewinds it: the thread draws numbers it has drawn before. So a real run that must
leave torch's random state as it found it (a measured step) puts the state back only when its
thread is the only one; with others alive the state is left to advance, as it would in a training
step. A run on fake or meta tensors draws nothing from the real generators and needs no fork at
all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from typing import Iterable, Iterator

import torch

__all__ = [
    "alone", "torch_states", "set_torch_states", "torch_random_kept",
    "generator_states", "set_generator_states",
    "copies", "put", "TensorValues", "values_kept",
    "AUTOCAST_DEVICES", "AutocastState", "autocast_state", "autocast_kept",
]


def alone() -> bool:
    """No other Python thread is alive (none can draw from a global generator meanwhile)."""
    return threading.active_count() == 1


def torch_states() -> list[torch.Tensor]:
    """torch's CPU generator state, and each initialised CUDA device's."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return states


def set_torch_states(states: list[torch.Tensor]) -> None:
    """Set the states :func:`torch_states` returned (nothing when they are already so)."""
    now = torch_states()
    if len(now) == len(states) and all(torch.equal(a, b) for a, b in zip(now, states)):
        return
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state_all(states[1:])


@contextlib.contextmanager
def torch_random_kept() -> Iterator[None]:
    """torch's random states as they were on exit, when this thread was alone throughout."""
    was_alone = alone()
    saved = torch_states() if was_alone else None
    try:
        yield
    finally:
        if saved is not None and alone():
            set_torch_states(saved)


def generator_states(generators: Iterable[torch.Generator]) -> list[torch.Tensor]:
    """The states of ``torch.Generator`` objects (a model's own), in order."""
    return [g.get_state() for g in generators]


def set_generator_states(generators: Iterable[torch.Generator],
                         states: Iterable[torch.Tensor]) -> None:
    """Set the states :func:`generator_states` returned, pairwise."""
    for g, state in zip(generators, states):
        g.set_state(state)


def copies(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Detached copies of the tensors' values, in order."""
    return [t.detach().clone() for t in tensors]


def put(tensors: Iterable[torch.Tensor], values: Iterable[torch.Tensor]) -> None:
    """Copy ``values`` into ``tensors`` in place, pairwise (autograd does not see it)."""
    with torch.no_grad():
        for t, value in zip(tensors, values):
            t.copy_(value)


class TensorValues:
    """The values tensors had when they were taken (or added), put back by :meth:`restore`.

    A tensor is taken once: adding it again keeps the value it had first. Restoring writes in
    place, so whoever holds the tensors (a module, an optimizer) sees the old values.
    """

    def __init__(self, tensors: Iterable[torch.Tensor] = ()) -> None:
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.add(tensors)

    def add(self, tensors: Iterable[torch.Tensor]) -> None:
        """Take the values of the tensors not taken yet."""
        for t in tensors:
            if id(t) not in self._saved:
                self._saved[id(t)] = (t, t.detach().clone())

    def restore(self) -> None:
        """Put every value taken back (again on each call)."""
        saved = list(self._saved.values())
        put((t for t, _ in saved), (value for _, value in saved))

    def __len__(self) -> int:
        return len(self._saved)


@contextlib.contextmanager
def values_kept(tensors: Iterable[torch.Tensor]) -> Iterator[TensorValues]:
    """The tensors' values put back on exit, however the block ends."""
    saved = TensorValues(tensors)
    try:
        yield saved
    finally:
        saved.restore()


AUTOCAST_DEVICES = ("cpu", "cuda")
"""The device types whose autocast state is read and set."""


@dataclasses.dataclass(frozen=True)
class AutocastState:
    """Autocast's state: ``(enabled, dtype)`` per device of :data:`AUTOCAST_DEVICES`, in order,
    and whether autocast caches casts."""

    devices: tuple[tuple[bool, torch.dtype], ...]
    cache: bool

    def flat(self) -> tuple[object, ...]:
        """``(cpu enabled, cpu dtype, cuda enabled, cuda dtype)``."""
        return tuple(itertools.chain.from_iterable(self.devices))

    def apply(self) -> None:
        """Make this the autocast state."""
        for device, (enabled, dtype) in zip(AUTOCAST_DEVICES, self.devices):
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(self.cache)


def autocast_state() -> AutocastState:
    """The autocast state now."""
    return AutocastState(
        tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
              for d in AUTOCAST_DEVICES),
        torch.is_autocast_cache_enabled(),
    )


@contextlib.contextmanager
def autocast_kept() -> Iterator[None]:
    """The autocast state put back on exit (a forward that enters autocast and fails)."""
    saved = autocast_state()
    try:
        yield
    finally:
        saved.apply()
