"""capture/traceless.py: a capture attempt leaves the model as it found it and reports what a
graph could not replay."""

from __future__ import annotations

import random
import threading

import numpy as np
import torch
import torch.nn as nn

from fxckpt.capture.generators import same_state
from fxckpt.capture.traceless import Traceless, hooks_off
from fxckpt.errors import grad_mode_left


class Busy(nn.Module):
    """A forward that does every kind of thing a capture must undo or report."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.register_buffer("seen", torch.zeros(1))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1  # a buffer written in place
        self.calls += 1  # a Python attribute changed
        self.last = x.sum()  # an attribute added
        self.fc.register_forward_hook(lambda m, i, o: None)  # a hook installed at first call
        return self.fc(x) * random.random()  # a Python random draw


def test_everything_the_forward_changed_is_put_back_and_reported() -> None:
    model = Busy()
    state = random.getstate()
    with Traceless(model) as guard:
        model(torch.randn(1, 2))
    assert model.seen.item() == 0.0 and model.calls == 0 and "last" not in vars(model)
    assert not model.fc._forward_hooks  # removed without complaint
    # the draw came from a copy of the global generator (and the state is also rewound when no
    # other thread could have drawn meanwhile; a test session may hold other tests' threads)
    assert random.getstate() == state
    assert guard.changes[0].startswith("the forward draws from Python's `random` module")
    assert "the forward changes `calls` (from 0 to 1)" in guard.changes
    assert [(path, name) for path, name, _ in guard.assigned] == [("", "last")]
    assert len(guard.changes) == 2


def test_grad_mode_left_off_is_reported() -> None:
    class Off(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch.set_grad_enabled(False)
            return x

    with Traceless(Off()) as guard:
        Off()(torch.ones(1))
    assert torch.is_grad_enabled()
    assert guard.changes == [grad_mode_left("the forward", False)]
    assert guard.changes[0].startswith(
        "the forward turns gradients off (torch.set_grad_enabled) and leaves them so when it "
        "returns")


def test_hooks_off_silences_hooks_and_keeps_the_kinds_asked_for() -> None:
    fired: list[str] = []
    model = nn.Linear(2, 2)
    model.register_forward_hook(lambda m, i, o: fired.append("user"))
    with hooks_off([model]):
        model(torch.ones(1, 2))
    model(torch.ones(1, 2))
    assert fired == ["user"]  # back on after the block

    class Kept:
        def __call__(self, m: nn.Module, i: tuple, o: torch.Tensor) -> None:
            fired.append("kept")

    model.register_forward_hook(Kept())
    with hooks_off([model], spare=(Kept,)):
        model(torch.ones(1, 2))
    assert fired == ["user", "kept"]  # the user's hook stays silent, the kept kind runs


def test_random_state_is_not_rewound_while_another_thread_could_draw() -> None:
    """A capture never rewinds a data-loading thread's random numbers, and its own module-level
    draws come from a copy of the global generator: afterwards the global stream holds exactly
    the other thread's draws. This thread's draws are still reported."""
    go, done, stop = threading.Event(), threading.Event(), threading.Event()
    drawn: list[float] = []

    def loader() -> None:  # a data-loading thread drawing while the capture runs
        go.wait()
        drawn.extend([random.random(), float(np.random.uniform())])
        done.set()
        stop.wait()

    other = threading.Thread(target=loader)
    other.start()
    try:
        model = Busy()
        python, numpy = random.Random(), np.random.RandomState()
        python.setstate(random.getstate())
        numpy.set_state(np.random.get_state())
        with Traceless(model) as guard:
            go.set()
            done.wait()
            model(torch.randn(1, 2))
            np.random.uniform()  # a numpy draw on this thread too
        assert drawn == [python.random(), float(numpy.uniform())]  # the real stream
        assert random.getstate() == python.getstate()  # its draws kept, this thread's unseen
        assert same_state(np.random.get_state(), numpy.get_state())
        assert guard.changes[0].startswith("the forward draws from Python's `random` module")
        assert guard.changes[1].startswith("the forward draws from numpy's global random")
    finally:
        stop.set()
        other.join()
