"""config.py: transform's keywords as one frozen TransformConfig, what it derives from them
(strategy name, pipelining, whole-graph needs, the saved dict) and its checks against a model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fxckpt.budget import Budget
from fxckpt.config import TransformConfig
from fxckpt.errors import ConfigError
from fxckpt.strategy import Budgeted, Depth, Every
from handmade import plan
from models import MLP


def test_from_options_parses_the_budget_and_keeps_other_options() -> None:
    config = TransformConfig.from_options(budget="64KiB", capture="graph", selective=False)
    assert config.strategy == Budgeted(Budget(bytes=64 * 1024))
    assert config.budget == Budget(bytes=64 * 1024)
    assert (config.capture, config.selective, config.strategy_name) == ("graph", False, "budget")
    assert TransformConfig.from_options(every=2).budget is None


@pytest.mark.parametrize("config, name", [
    (TransformConfig(), "none"),
    (TransformConfig(force={"layers.0": "save"}), "force"),
    (TransformConfig(strategy=Depth(1)), "depth"),
    (TransformConfig.from_options(plan=plan()), "replay"),
])
def test_the_strategy_name(config: TransformConfig, name: str) -> None:
    assert config.strategy_name == name


def test_force_is_a_private_copy_and_the_config_is_frozen() -> None:
    force = {"layers.0": "save"}
    config = TransformConfig(force=force)
    force["layers.1"] = "recompute"
    assert config.force == {"layers.0": "save"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.capture = "dynamo"


def test_any_pipeline_option_pipelines_and_pipelined_plans_are_not_verified() -> None:
    assert not TransformConfig().pipelined and TransformConfig().verifies
    for options in ({"chunks": 2}, {"devices": ("cpu",)}, {"stages": 2}, {"balance": (3,)}):
        config = TransformConfig(**options)
        assert config.pipelined and not config.verifies
    assert not TransformConfig(verify=False).verifies


@pytest.mark.parametrize("options, needed", [
    ({}, ""),
    ({"chunks": 2}, "pipeline stages (chunks=, devices=)"),
    ({"plan": "saved"}, "a replayed plan (plan=)"),
    ({"offload": "auto"}, "offload='auto'"),
    ({"loss_fn": len}, "loss_fn= (the loss a plan is verified with, applied to the model's "
                       "output)"),
])
def test_what_needs_one_whole_graph_is_named(options: dict, needed: str) -> None:
    options = {k: plan() if k == "plan" else v for k, v in options.items()}
    assert TransformConfig.from_options(**options).whole_graph_needed == needed


@pytest.mark.parametrize("capture, method", [("auto", "auto"), ("graph", "auto"),
                                             ("dynamo", "auto"), ("export", "export"),
                                             ("symbolic_trace", "symbolic_trace")])
def test_the_graph_method(capture: str, method: str) -> None:
    assert TransformConfig(capture=capture).graph_method == method


def test_to_dict_writes_the_strategy_and_only_the_options_that_differ() -> None:
    assert TransformConfig(strategy=Every(2)).to_dict() == {
        "every": 2, "depth": None, "force": {}, "budget": None}
    out = TransformConfig(strategy=Budgeted(Budget(fraction=0.5)), capture="export",
                          selective=False, chunks=2, devices=("cpu", "cpu")).to_dict()
    assert out == {"every": None, "depth": None, "force": {},
                   "budget": {"bytes": None, "fraction": 0.5}, "selective": False,
                   "capture": "export", "chunks": 2, "devices": ["cpu", "cpu"],
                   "checkpoint": "except_last", "stages": None, "balance": None}


def test_a_valid_config_validates_to_itself() -> None:
    config = TransformConfig(strategy=Depth(2), force={"op:aten.mm": "save"})
    assert config.validate(MLP()) is config


@pytest.mark.parametrize("options, message", [
    ({"strategy": Depth(4)}, "depth=4 is deeper than the model: its deepest module "
                             "'layers.0.fc' has depth 3; use depth <= 3"),
    ({"force": {"op:aten.nope": "save"}}, "force['op:aten.nope'] names no aten op"),
    ({"force": {"op:mm": "save"}}, "force['op:mm'] names no aten op"),
    ({"force": {"layers.0.fx": "save"}}, "did you mean 'layers.0.fc'"),
    ({"selective": 1}, "selective must be True or False (got 1)"),
    ({"verify": "yes"}, "verify must be True, False or None (got 'yes')"),
    ({"loss_fn": 3}, "loss_fn must be a function loss_fn(output, *args, **kwargs) -> scalar "
                     "tensor (got int)"),
    ({"devices": "cpu"}, "devices must be a non-empty list of devices, one per stage (got 'cpu')"),
    ({"balance": 3}, "balance must be a list of node counts or module paths (got 3)"),
    ({"stages": 0}, "stages must be a positive integer (got 0)"),
    ({"offload": "sometimes"}, "offload must be True, False or 'auto' (got 'sometimes')"),
    ({"offload": "auto"}, "offload='auto' lets the budget solver choose"),
    ({"offload": True, "offload_device": "cpu", "offload_threshold": -1},
     "offload_threshold must be a non-negative integer of bytes (got -1)"),
    ({"capture": "dynamo", "chunks": 2}, "capture='dynamo' plans each graph Dynamo breaks the "
                                         "forward into, and pipeline stages"),
])
def test_a_bad_option_fails_validation_naming_it(options: dict, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        TransformConfig(**options).validate(MLP())
    assert message in str(caught.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="offload needs no device= with CUDA")
def test_offload_without_cuda_asks_for_a_device_or_a_profile() -> None:
    with pytest.raises(ConfigError, match="this machine has no CUDA device; pass "
                                          "offload_device='cpu'"):
        TransformConfig(offload=True).validate(MLP())
    config = TransformConfig(offload=True, device_profile="h100")
    assert config.validate(MLP()) is config
