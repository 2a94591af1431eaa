"""api.py: ``fxckpt.transform``'s own handling of its arguments (the model, plans given as
dicts, device and balance lists, example inputs) before the config checks them."""

from __future__ import annotations

import pytest
import torch

import fxckpt
from fxckpt.api import _as_plan, _as_tuple
from fxckpt.errors import ConfigError, ConfigTypeError
from fxckpt.module import is_transformed
from handmade import Tiny, plan


def test_the_result_is_the_model_transformed_on_the_models_own_state() -> None:
    model = Tiny()
    tm = fxckpt.transform(model, every=1)
    assert isinstance(tm, Tiny) and is_transformed(tm) and not is_transformed(model)
    assert tm.__dict__ is model.__dict__ and tm.fc1 is model.fc1


def test_a_transformed_model_is_not_transformed_again() -> None:
    tm = fxckpt.transform(Tiny(), every=1)
    with pytest.raises(ConfigError, match=r"^this Tiny is already transformed; transform the "
                                          r"original model \(fxckpt.inspect\(tm\).model\)"):
        fxckpt.transform(tm, every=2)


def test_a_function_is_not_a_model() -> None:
    with pytest.raises(ConfigTypeError, match=r"^model must be a torch.nn.Module \(got "
                                              r"function\); wrap a function"):
        fxckpt.transform(lambda x: x)


def test_example_inputs_plan_at_transform_time_and_must_be_a_sequence() -> None:
    tm = fxckpt.transform(Tiny(), every=1, capture="graph", example_inputs=(torch.randn(3, 4),))
    assert fxckpt.inspect(tm).plan.strategy == "every"
    with pytest.raises(ConfigError, match=r"^example_inputs must be a tuple of positional "
                                          r"inputs \(got Tensor\); write example_inputs=\(x,\)"):
        fxckpt.transform(Tiny(), every=1, example_inputs=torch.randn(3, 4))


def test_a_plan_is_taken_as_a_plan_or_its_dict() -> None:
    saved = plan()
    assert _as_plan(None) is None and _as_plan(saved) is saved
    assert _as_plan(saved.to_dict()) == saved
    with pytest.raises(ConfigError, match=r"^plan is not a saved fxckpt plan \("):
        _as_plan({"segments": []})
    with pytest.raises(ConfigError, match=r"^plan must be a fxckpt.Plan or its to_dict\(\) "
                                          r"\(got str\)$"):
        _as_plan("plan.json")


def test_lists_become_tuples_with_devices_as_strings() -> None:
    assert _as_tuple([torch.device("cpu"), "cuda:1"], "devices") == ("cpu", "cuda:1")
    assert _as_tuple((3, "layers.2"), "balance") == (3, "layers.2")
    for value in ("cpu", torch.device("cpu"), 3):
        with pytest.raises(ConfigError, match=r"^devices must be a list \(got .*\); e.g. "
                                              r"devices=\['cpu', 'cpu'\]$"):
            _as_tuple(value, "devices")


def test_devices_reach_the_config_as_strings() -> None:
    tm = fxckpt.transform(Tiny(), every=1, devices=[torch.device("cpu")] * 2, capture="graph")
    assert fxckpt.inspect(tm).config.devices == ("cpu", "cpu")
