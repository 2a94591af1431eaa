"""capture/generators.py: the Python and numpy random generators a model holds are found where
users keep them, and a capture or measuring run leaves them as they were."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
import torch.nn as nn

from fxckpt.capture import generators
from fxckpt.capture.generators import held_generators, same_state, set_state, state_of
from fxckpt.capture.traceless import Traceless


class Augment:
    """A callable helper with its own generator (not a module)."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * float(self.rng.uniform(0.9, 1.1))


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.rand = random.Random(0)
        self.rngs = {"mask": np.random.RandomState(0)}
        self.pair = [np.random.default_rng(2)]
        self.augment = Augment()
        self.fc.noise = random.Random(3)  # on a child
        self.same = self.rand  # the same generator twice: found once
        self.words = ["w"] * 1000  # a long list: not walked past its first entries

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = (self.rand.random() + self.rngs["mask"].uniform() + self.pair[0].uniform()
                 + self.fc.noise.random())
        return self.fc(self.augment(x)) * scale


def test_generators_are_found_where_users_keep_them_with_their_paths() -> None:
    model = Holder()
    found = dict(held_generators(model))
    assert set(found) == {"<root>.rand", "<root>.rngs['mask']", "<root>.pair[0]",
                          "<root>.augment.rng", "fc.noise"}
    assert found["<root>.rand"] is model.rand and found["fc.noise"] is model.fc.noise
    assert held_generators(nn.Linear(2, 2)) == []


def test_deep_and_far_generators_are_out_of_reach() -> None:
    model = nn.Linear(2, 2)
    model.deep = {"a": {"b": {"c": random.Random(0)}}}  # three levels below the attribute
    model.far = [0] * generators.ITEMS + [random.Random(0)]  # past the entries looked at
    model.near = {"a": {"b": random.Random(0)}}
    assert [path for path, _ in held_generators(model)] == ["<root>.near['a']['b']"]


@pytest.mark.parametrize("make", [
    lambda: random.Random(0), lambda: np.random.default_rng(0),
    lambda: np.random.Generator(np.random.MT19937(0)), lambda: np.random.RandomState(0),
], ids=["random", "pcg64", "mt19937", "random_state"])
def test_a_state_taken_puts_the_generator_back(make) -> None:  # type: ignore[no-untyped-def]
    generator = make()
    state = state_of(generator)
    first = [generator.random() for _ in range(3)]
    assert not same_state(state_of(generator), state)
    set_state(generator, state)
    assert same_state(state_of(generator), state)
    assert [generator.random() for _ in range(3)] == first


def test_traceless_puts_held_generators_back_and_reports_each_draw() -> None:
    model = Holder()
    want = [state_of(g) for _, g in held_generators(model)]
    with Traceless(model) as guard:
        model(torch.randn(1, 2))
    assert all(same_state(state_of(g), s) for (_, g), s in zip(held_generators(model), want))
    drawn = [c for c in guard.changes if "random generator, and draws from it" in c]
    assert len(drawn) == 5
    assert any(c.startswith("the forward reads `<root>.augment.rng`, a numpy.random._generator."
                            "Generator random generator") for c in drawn)
    # put back even while another thread runs (the global generators are not, then)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        with Traceless(model):
            model(torch.randn(1, 2))
    finally:
        stop.set()
        thread.join()
    assert all(same_state(state_of(g), s) for (_, g), s in zip(held_generators(model), want))


def test_a_generator_held_but_not_drawn_from_is_no_change() -> None:
    model = Holder()
    model.forward = lambda x: model.fc(x)  # type: ignore[method-assign]
    with Traceless(model) as guard:
        model(torch.randn(1, 2))
    assert guard.changes == []
