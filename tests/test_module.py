"""module.py: the transformed module is the model (one ``__dict__``, the model's class, name and
forward signature), with fxckpt's own state in one slot; pickling rebuilds it from the model."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

from fxckpt.config import TransformConfig
from fxckpt.module import (STATE, TransformedModule, dispatcher_of, is_transformed,
                           make_transformed)
from fxckpt.strategy import Every
from handmade import Tiny


class Keyed(torch.nn.Module):
    """Adds its inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, *, bias: float = 0.0) -> torch.Tensor:
        """The model's own docstring."""
        return self.fc(x) + bias


def _transformed(model: torch.nn.Module) -> TransformedModule:
    return make_transformed(model, TransformConfig(strategy=Every(1)))


def test_one_state_shared_both_ways_and_the_model_gains_no_attribute() -> None:
    model = Keyed()
    before = set(model.__dict__)
    tm = _transformed(model)
    assert set(model.__dict__) == before and STATE not in model.__dict__
    tm.temperature = 2.0
    assert model.temperature == 2.0
    model.eval()
    assert not tm.training
    assert dispatcher_of(tm).config.strategy == Every(1)


def test_the_class_is_the_models_with_transformed_module_first_made_once() -> None:
    tm, other = _transformed(Keyed()), _transformed(Keyed())
    cls = type(tm)
    assert cls is type(other) and cls.__mro__[1:3] == (TransformedModule, Keyed)
    assert (cls.__name__, cls.__qualname__, cls.__doc__) == ("Keyed", Keyed.__qualname__,
                                                              "Adds its inputs.")
    assert is_transformed(tm) and not is_transformed(Keyed()) and not is_transformed(3)
    assert repr(tm).startswith("fxckpt.Keyed(")


def test_forward_looks_like_the_models_for_frameworks_that_read_it() -> None:
    tm = _transformed(Keyed())
    assert inspect.signature(tm.forward) == inspect.signature(Keyed().forward)
    assert tm.forward.__doc__ == "The model's own docstring."


def test_eval_and_no_grad_run_the_models_own_forward() -> None:
    model = Keyed()
    tm = _transformed(model)
    x = torch.randn(3, 2)
    with torch.no_grad():
        assert torch.equal(tm(x, bias=1.0), model(x, bias=1.0))
    assert dispatcher_of(tm).whole_graphs() == []  # nothing captured or planned


def test_a_copy_is_rebuilt_from_the_model_and_the_options() -> None:
    tm = _transformed(Tiny()).eval()
    clone = copy.deepcopy(tm)
    assert is_transformed(clone) and not clone.training
    assert clone.fc1 is not tm.fc1 and torch.equal(clone.fc1.weight, tm.fc1.weight)
    assert dispatcher_of(clone).config == dispatcher_of(tm).config


def test_moving_the_tensors_forgets_the_plans_and_a_no_op_move_does_not(monkeypatch) -> None:
    tm = _transformed(Tiny())
    forgot = []
    monkeypatch.setattr(dispatcher_of(tm), "forget", lambda: forgot.append(True))
    tm.to("cpu")
    assert forgot == []
    tm.double()
    assert forgot == [True]


def test_a_compiled_model_is_transformed_uncompiled_with_a_warning(caplog) -> None:
    model = Keyed()
    model.__dict__["_compiled_call_impl"] = lambda *a: None  # what model.compile() sets
    with caplog.at_level("WARNING", logger="fxckpt.module"):
        _transformed(model)
    assert "Keyed was compiled with module.compile(); the transformed module runs uncompiled" \
        in caplog.text


@pytest.mark.parametrize("model", [Keyed(), Tiny()])
def test_a_transformed_class_is_not_derived_again(model: torch.nn.Module) -> None:
    tm = _transformed(model)
    assert type(_transformed(tm)) is type(tm)
