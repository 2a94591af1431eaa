"""serve/dynamo/refusals.py: what the Dynamo path refuses by name (FSDP2 sharding, a Python
``random.Random`` the forward draws from) and the places Dynamo leaves uncompiled."""

from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import TorchDispatchMode

from fxckpt.capture import generators
from fxckpt.errors import CaptureError, ConfigError
from fxckpt.serve.dynamo.refusals import (refuse_fsdp, refuse_python_draws, sharded,
                                          uncompiled_here)


class ShardedLinear(FSDPModule, torch.nn.Linear):
    """The class ``fully_shard`` gives a ``Linear`` it manages."""


def Sharded(*sizes: int) -> torch.nn.Module:
    """An FSDP2-managed module as ``isinstance`` sees it, without a process group: the class
    swap ``fully_shard`` makes."""
    module = torch.nn.Linear(*sizes)
    module.__class__ = ShardedLinear
    return module


def test_a_plain_model_is_not_sharded_and_not_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert sharded(model) == []
    assert refuse_fsdp(model) is None


def test_sharded_modules_are_named_root_first_and_refused_by_the_first() -> None:
    inner = torch.nn.Sequential(Sharded(2, 2), torch.nn.ReLU(), Sharded(2, 2))
    assert sharded(inner) == ["0", "2"]
    with pytest.raises(ConfigError, match=r"^capture='dynamo' cannot plan a model sharded with "
                                          r"fully_shard \(0 is\).*capture='auto'"):
        refuse_fsdp(inner)
    root = Sharded(2, 2)
    assert sharded(root) == ["<root>"]


def test_generators_left_alone_are_not_refused() -> None:
    rng = random.Random(0)
    refuse_python_draws([("drop.rng", rng, generators.state_of(rng))])
    refuse_python_draws([])


def test_a_draw_is_refused_by_name_and_every_generator_put_back() -> None:
    a, b, c = random.Random(0), random.Random(1), random.Random(2)
    held = [(name, g, generators.state_of(g)) for name, g in (("a", a), ("drop.rng", b),
                                                              ("c", c))]
    first = b.random()
    c.random()
    with pytest.raises(CaptureError, match=r"^the forward reads `drop.rng`, a random.Random "
                                           r"random generator, and draws from it: Dynamo"):
        refuse_python_draws(held)
    assert b.random() == first  # put back where it was before the call
    assert c.getstate() == random.Random(2).getstate()
    assert a.getstate() == random.Random(0).getstate()


def test_dynamo_compiles_here_outside_dispatch_modes_and_transforms() -> None:
    assert uncompiled_here() == ""


def test_a_users_dispatch_mode_is_named() -> None:
    class Logging(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Logging():
        assert uncompiled_here() == "a TorchDispatchMode (Logging)"


def test_torch_func_transforms_are_named() -> None:
    seen = []

    def f(x: torch.Tensor) -> torch.Tensor:
        seen.append(uncompiled_here())
        return x

    torch.func.vmap(f)(torch.ones(2, 3))
    assert seen == ["torch.func transforms (vmap, grad, jacrev)"]
