"""Promise 5: bad input gets a clear error with the value seen and the fix."""

from __future__ import annotations

import pytest
import torch

import fxckpt
from fxckpt.passes.capture import capture
from models import MLP, DataDependent, Noisy
from support import loss_of


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"every": 2, "depth": 1}, "give at most one strategy, got every=2 and depth=1"),
        ({"every": 0}, "every must be a positive integer (got 0)"),
        ({"every": -1}, "every must be a positive integer (got -1)"),
        ({"every": 2.5}, "every must be a positive integer (got 2.5)"),
        ({"every": True}, "every must be a positive integer (got True)"),
        ({"depth": 0}, "depth must be a positive integer (got 0)"),
        (
            {"depth": 4},
            "depth=4 is deeper than the model: its deepest module 'layers.0.fc' has depth 3",
        ),
        (
            {"force": {"layers.9": "save"}},
            "force names module 'layers.9', which the model does not have",
        ),
        (
            {"force": {"layers.0": "sometimes"}},
            "force['layers.0'] must be one of ('recompute', 'save') (got 'sometimes')",
        ),
        ({"force": ["layers.0"]}, "force must be a dict of module path"),
    ],
)
def test_bad_options_raise_config_error(kwargs: dict, message: str) -> None:
    with pytest.raises(fxckpt.ConfigError) as e:
        fxckpt.transform(MLP(), **kwargs)
    assert message in str(e.value)
    assert isinstance(e.value, ValueError)


def test_force_suggests_close_paths() -> None:
    with pytest.raises(fxckpt.ConfigError, match=r"did you mean 'layers.1'"):
        fxckpt.transform(MLP(), force={"layer.1": "recompute"})


def test_non_module_is_rejected() -> None:
    with pytest.raises(
        fxckpt.ConfigError, match=r"model must be a torch.nn.Module \(got function\)"
    ):
        fxckpt.transform(lambda x: x * 2, every=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("call", [fxckpt.transform, fxckpt.pareto])
def test_a_non_module_is_a_type_error(call: object) -> None:
    with pytest.raises(TypeError) as e:
        call("not a module")  # type: ignore[operator]
    assert isinstance(e.value, fxckpt.ConfigError)
    assert str(e.value).startswith("model must be a torch.nn.Module (got str)")


def test_untraceable_model_without_inputs_names_the_fixes() -> None:
    with pytest.raises(fxckpt.CaptureError) as e:
        capture(DataDependent())
    text = str(e.value)
    assert "symbolic_trace failed with TraceError" in text
    assert "pass example inputs" in text and "torch.fx.wrap" in text and "concrete_args" in text


def test_untraceable_model_reports_both_capture_failures() -> None:
    tm = fxckpt.transform(DataDependent(), every=1)
    with pytest.raises(fxckpt.CaptureError) as e:
        tm(torch.randn(2, 4))
    text = str(e.value)
    assert "symbolic_trace failed with TraceError" in text
    assert "export failed with" in text and "torch.cond" in text


def test_example_inputs_must_be_a_tuple() -> None:
    with pytest.raises(
        fxckpt.ConfigError, match=r"example_inputs must be a tuple .* \(got Tensor\)"
    ):
        fxckpt.transform(
            MLP(), every=1, example_inputs=torch.randn(2, 32)  # type: ignore[arg-type]
        )


def test_plan_before_first_call_says_how_to_get_one() -> None:
    tm = fxckpt.transform(MLP(), every=1)
    with pytest.raises(fxckpt.NotPlannedError, match="plans at its first training call"):
        fxckpt.inspect(tm).plan


def test_second_backward_without_retain_graph() -> None:
    x = torch.randn(4, 32, requires_grad=True)
    tm = fxckpt.transform(MLP(), every=1)
    loss = loss_of(tm(x))
    loss.backward()
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        loss.backward()


def test_second_backward_with_retain_graph_matches() -> None:
    x = torch.randn(4, 32, requires_grad=True)
    tm = fxckpt.transform(MLP(p=0.0), every=1)
    loss = loss_of(tm(x))
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * first)


class ShapeShifter(torch.nn.Module):
    """Recomputes differently: a counter changes the shape it makes the second time."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).relu()


def test_recompute_mismatch_names_the_segment() -> None:
    model = ShapeShifter()
    x = torch.randn(3, 4, requires_grad=True)
    tm = fxckpt.transform(model, every=1, example_inputs=(x,))
    segment = fxckpt.inspect(tm).graph_module.segment_0
    original = segment.forward
    calls = {"n": 0}

    def flaky(inp: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return original(inp if calls["n"] == 1 else inp.double().float()[:2])

    segment.forward = flaky
    out = tm(x)
    with pytest.raises(torch.utils.checkpoint.CheckpointError) as e:
        out.sum().backward()
    text = str(e.value)
    assert "tensor at position 0" in text
    assert "saved metadata: {'segment': 'segment_0', 'shape': torch.Size([3, 4])" in text
    assert "recomputed metadata: {'segment': 'segment_0', 'shape': torch.Size([2, 4])" in text
