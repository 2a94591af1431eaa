"""pipeline/build.py: the pipelined module built from an annotated graph, with every pipeline
argument checked when it is built, and the stages and schedule it describes."""

from __future__ import annotations

import pytest
import torch

from fxckpt.errors import ConfigError
from fxckpt.pipeline.build import PipelinedModule, build_pipeline
from models import MLP
from stage_graphs import annotated_graph as _graph


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"chunks": 0}, ConfigError, r"chunks must be a positive integer \(got 0\)"),
        ({"chunks": -2}, ConfigError, r"chunks must be a positive integer \(got -2\)"),
        ({"chunks": 2.5}, ConfigError, r"chunks must be a positive integer \(got 2.5\)"),
        ({"chunks": True}, ConfigError, r"chunks must be a positive integer \(got True\)"),
        (
            {"checkpoint": "sometimes"},
            ConfigError,
            r"checkpoint must be one of 'always', 'except_last', 'never' \(got 'sometimes'\)",
        ),
        (
            {"devices": ["cpu"] * 21},
            ConfigError,
            r"stages must be at most the graph's 19 compute node\(s\) \(got 21 stages\)",
        ),
        (
            {"stages": 2, "devices": ["cpu"] * 3},
            ConfigError,
            r"stages=2 needs 2 devices or a single one \(got 3",
        ),
        (
            {"balance": [5, 5]},
            ConfigError,
            r"balance must sum to the graph's 19 compute node\(s\) "
            r"\(got \[5, 5\], which sums to 10\)",
        ),
        ({"devices": ["cuda:7"]}, ConfigError, r"device 'cuda:7' does not exist"),
        (
            {"devices": ["cpu", "tpu:0"]},
            ConfigError,
            r"devices must be torch devices or strings like 'cpu'",
        ),
        (
            {"devices": "cpu"},
            ConfigError,
            r"devices must be a non-empty list of devices, one per stage \(got 'cpu'\)",
        ),
    ],
)
def test_bad_arguments_fail_at_build_time(kwargs: dict, error: type, message: str) -> None:
    model, x = MLP(depth=6), torch.randn(4, 32)
    options = {"chunks": 2, "devices": ["cpu", "cpu"], **kwargs}
    with pytest.raises(error, match=message) as e:
        build_pipeline(_graph(model, x)[0], **options)
    assert isinstance(e.value, ValueError)


def test_the_built_module_runs_the_graph_and_describes_its_stages() -> None:
    x = torch.randn(4, 32)
    gm, _ = _graph(MLP(depth=4, p=0.0), x)
    pm = build_pipeline(gm, chunks=2, devices=["cpu"], stages=2, checkpoint="always")
    assert isinstance(pm, PipelinedModule) and pm.chunks == 2
    # two micro-batches of 2: the graph run on each (a matmul over 2 rows need not round as
    # one over 4 does: on an AMD EPYC the whole batch differs in the last bits)
    torch.testing.assert_close(pm(x), torch.cat([gm(x[:2]), gm(x[2:])]), rtol=0, atol=0)
    assert len(pm.stage_modules) == 2 and pm.training == gm.training
    view = pm.view()
    assert [s.device for s in view.stages] == ["cpu", "cpu"]  # one device given: every stage
    assert (view.chunks, view.checkpoint, view.stop) == (2, "always", 2)
    assert sum(s.nodes for s in view.stages) == len(pm.stage_plan.stage_of)
    assert pm.describe() == str(view)


def test_module_paths_as_balance_make_one_more_stage_than_paths() -> None:
    x = torch.randn(4, 32)
    gm, _ = _graph(MLP(depth=4), x)
    pm = build_pipeline(gm, chunks=2, devices=["cpu"], balance=["layers.2"])
    assert len(pm.stage_modules) == 2
    assert [s.modules[0] for s in pm.view().stages] == ["layers.0", "layers.2"]


def test_balance_and_devices_must_agree_on_the_stages() -> None:
    gm, _ = _graph(MLP(depth=4), torch.randn(4, 32))
    with pytest.raises(ConfigError, match=r"^partition: balance describes 2 stage\(s\) but "
                                          r"stages=3; make them agree$"):
        build_pipeline(gm, chunks=2, devices=["cpu"] * 3, balance=["layers.2"])
    with pytest.raises(ConfigError, match=r"^stages must be a positive integer \(got 0\)$"):
        build_pipeline(gm, chunks=2, devices=["cpu"], stages=0)
