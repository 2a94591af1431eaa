"""capture/captured.py: a model captured as a GraphModule that computes what it computes, or
refused saying why and how to fix it; the Captured feeds it the model's call arguments."""

from __future__ import annotations

import pytest
import torch

from fxckpt.capture.captured import SYMBOLIC, capture
from fxckpt.errors import CaptureError
from fxckpt.runtime.assign import assign
from handmade import Tiny


class Flagged(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0, double: bool = False) -> torch.Tensor:
        y = self.fc(x) * scale
        return y * 2 if double else y


def test_symbolic_trace_captures_a_shape_free_graph_of_the_model() -> None:
    model = Tiny().eval()
    captured = capture(model)
    assert captured.method == SYMBOLIC and captured.model is model
    assert captured.shape_free and captured.accepts(((100, 4),))
    x = torch.randn(5, 4)
    assert torch.equal(captured.call(captured.gm, (x,), {}), model(x))
    assert captured.graph_args((x,), {}) == [x]


def test_non_tensor_arguments_are_baked_in_without_value_checks() -> None:
    model = Flagged()
    x = torch.randn(2, 4)
    captured = capture(model, (x,), {"scale": 0.5, "double": True})
    assert torch.equal(captured.call(captured.gm, (x,), {"scale": 0.5, "double": True}),
                       model(x, 0.5, True))
    assert not [n for n in captured.gm.graph.nodes if n.target is torch._assert]
    assert captured.graph_args((x,), {"double": True}) == [x, 1.0, True]


def test_an_attribute_the_forward_assigns_is_set_by_the_graph_every_call() -> None:
    class Keeps(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.last = x.relu()
            self.calls_seen = "yes"  # a plain value: set once, as the model's call left it
            return self.last * 2

    model = Keeps()
    captured = capture(model)
    assert [n.target for n in captured.gm.graph.nodes].count(assign) == 1
    assert model.calls_seen == "yes" and not hasattr(model, "last")
    x = torch.tensor([-1.0, 3.0])
    captured.gm(x)
    assert torch.equal(model.last, torch.tensor([0.0, 3.0]))


def test_a_forward_that_changes_python_state_is_refused_naming_the_change() -> None:
    class Counts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.steps = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.steps += 1
            return x * 2

    model = Counts()
    with pytest.raises(CaptureError, match=r"cannot capture Counts exactly: while it was "
                                           r"traced,\n  - .*steps"):
        capture(model)
    assert model.steps == 0  # put back


def test_global_module_hooks_are_refused() -> None:
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        with pytest.raises(CaptureError, match="^global module forward hooks are registered"):
            capture(Tiny())
    finally:
        handle.remove()


def test_a_model_that_does_not_trace_without_inputs_says_to_give_them() -> None:
    class Branches(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x if x.sum() > 0 else -x

    with pytest.raises(CaptureError) as caught:
        capture(Branches())
    text = str(caught.value)
    assert text.startswith("fxckpt could not capture Branches as a torch.fx graph.\n"
                           "  - symbolic_trace failed with TraceError")
    assert "pass example inputs" in text
    with pytest.raises(CaptureError, match="let fxckpt fall back to torch.export"):
        capture(Branches(), (torch.ones(2),), method=SYMBOLIC)
    with pytest.raises(CaptureError, match="^capture='export' needs the call's inputs"):
        capture(Branches(), method="export")
