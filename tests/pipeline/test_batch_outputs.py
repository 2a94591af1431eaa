"""pipeline/batch_outputs.py: the non-tensor outputs whose value follows the batch size."""

from __future__ import annotations

import torch
import torch.fx
import torch.nn as nn

from fxckpt.cost.annotate import annotate
from fxckpt.pipeline.batch_outputs import batch_outputs


class Counts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict:
        return {"y": self.fc(x), "n": x.shape[0], "width": x.shape[1], "rows": x.size(0) * 2}


def _annotated(model: nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    return annotate(torch.fx.symbolic_trace(model), [x])


def test_outputs_computed_from_the_batch_size_are_named() -> None:
    gm = _annotated(Counts(), torch.randn(3, 4))
    assert batch_outputs(gm) == ["output['n']", "output['rows']"]  # not the width


def test_a_graph_with_tensor_outputs_only_has_none() -> None:
    assert batch_outputs(_annotated(nn.Linear(4, 2), torch.randn(3, 4))) == []


def test_a_graph_that_runs_at_one_batch_size_only_has_none() -> None:
    class Fixed(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple:
            return x.reshape(3, 4) * 2, x.shape[0]  # fails at any other batch

    assert batch_outputs(_annotated(Fixed(), torch.randn(3, 4))) == []


def test_the_models_parameters_and_hooks_are_untouched() -> None:
    model = Counts()
    gm = _annotated(model, torch.randn(3, 4))
    fired: list[int] = []
    model.fc.register_forward_hook(lambda m, i, o: fired.append(1))  # the user's: never on fakes
    weight = model.fc.weight.clone()
    assert batch_outputs(gm) == ["output['n']", "output['rows']"]
    assert fired == [] and torch.equal(model.fc.weight, weight)
