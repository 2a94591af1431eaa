"""torch's global random state, saved and put back only when no other thread can be drawing.

``torch.random.fork_rng`` puts the generator back as it was when the block began. When another
Python thread (a data loader, an augmentation worker) draws from the same generator meanwhile, that
rewinds it: the thread draws numbers it has drawn before. So a real run that must leave torch's
random state as it found it (a measured step) puts the state back only when its thread is the
only one; with others alive the state is left to advance, as it would in a training step. A run
on fake or meta tensors draws nothing from the real generators and needs no fork at all.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

__all__ = ["torch_states", "set_torch_states", "alone", "torch_random_kept"]


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
