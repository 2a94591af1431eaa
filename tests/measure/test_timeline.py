"""measure/timeline.py: live bytes after every op of one measured training step, split into
forward and backward, with the module's gradients, buffers and RNG state put back."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from fxckpt.measure.timeline import OpTimeline, default_loss, measure_step
from fxckpt.runtime.state import alone


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)
        self.bn = torch.nn.BatchNorm1d(64)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.bn(torch.relu(self.fc(x))))


def test_the_default_loss_is_the_sum_of_squares_of_every_float_output() -> None:
    out = {"a": torch.tensor([1.0, 2.0]), "n": torch.tensor([3]), "b": [torch.tensor(3.0)]}
    assert default_loss(out).item() == 14.0
    assert default_loss(OrderedDict(a=torch.tensor([2.0]))).item() == 4.0
    with pytest.raises(ValueError, match="no floating-point tensor to take a loss of; pass loss="):
        default_loss((torch.tensor([1]), None))


def test_the_timeline_samples_each_op_with_its_phase() -> None:
    with OpTimeline() as timeline:
        a = torch.ones(256) * 2
        timeline.phase = "backward"
        b = a + 1
    assert [(phase, op) for phase, op, _ in timeline.samples] == [
        ("forward", "aten.ones.default"), ("forward", "aten.mul.Tensor"),
        ("backward", "aten.add.Tensor")]
    assert [live for _, _, live in timeline.samples] == [1024, 2048, 2048]
    del a, b


def test_a_measured_step_has_both_phases_and_leaves_the_module_as_it_was() -> None:
    model = Net()
    model.fc.weight.grad = torch.full_like(model.fc.weight, 7.0)
    mean = model.bn.running_mean.clone()
    x = torch.randn(32, 64)
    rng = torch.get_rng_state()
    was_alone = alone()  # with another thread alive the step's draws are left as drawn
    step = measure_step(model, (x,))
    assert step.forward and step.backward
    assert step.peak_bytes >= max(step.forward + step.backward) > 0
    assert torch.equal(model.fc.weight.grad, torch.full_like(model.fc.weight, 7.0))
    assert model.bn.bias.grad is None
    assert torch.equal(model.bn.running_mean, mean)
    assert torch.equal(torch.get_rng_state(), rng) or not was_alone


def test_a_given_loss_is_used() -> None:
    seen = []

    def loss(out: torch.Tensor) -> torch.Tensor:
        seen.append(out.shape)
        return out.sum()

    measure_step(Net(), (torch.randn(4, 64),), loss=loss)
    assert seen == [torch.Size([4, 64])] * 2  # the warm-up step and the measured one
