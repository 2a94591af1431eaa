"""runtime/user_checkpoint.py: a model's reentrant checkpoint call keeps eager's one visible
difference (no input requires grad: no gradient inside, torch's warning) and is otherwise the
captured op."""

from __future__ import annotations

import pytest
import torch

from fxckpt.runtime.user_checkpoint import reentrant


class Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor]:
        return (x * weight,)


class Body:
    """The captured body (a graph module, as Dynamo hands it) and the parameter it reads."""

    def __init__(self) -> None:
        self.gm = torch.fx.symbolic_trace(Scale())
        self.weight = torch.nn.Parameter(torch.full((3,), 2.0))

    def __call__(self, *operands: torch.Tensor) -> tuple[torch.Tensor]:
        return reentrant(self.gm, *operands)


def test_inputs_without_grad_run_the_body_under_no_grad_with_torchs_warning() -> None:
    body = Body()
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        (out,) = body(torch.ones(3), body.weight)
    assert torch.equal(out, torch.full((3,), 2.0)) and not out.requires_grad


def test_an_input_that_requires_grad_runs_the_captured_op_with_gradients() -> None:
    body = Body()
    x = torch.ones(3, requires_grad=True)
    (out,) = body(x, body.weight)
    out.sum().backward()
    assert torch.equal(out.detach(), torch.full((3,), 2.0))
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    assert torch.equal(body.weight.grad, torch.ones(3))


def test_a_parameter_passed_as_an_input_is_not_an_input_that_requires_grad() -> None:
    body = Body()
    with pytest.warns(UserWarning, match="Gradients will be None"):
        (out,) = body(body.weight, body.weight)
    assert not out.requires_grad


def test_under_no_grad_nothing_warns(recwarn) -> None:
    body = Body()
    with torch.no_grad():
        (out,) = body(torch.ones(3), body.weight)
    assert torch.equal(out, torch.full((3,), 2.0))
    assert not [w for w in recwarn if "requires_grad" in str(w.message)]
