"""The user's loss, measured on fake outputs: what the planner's loss op stands for."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from fxckpt.measure.loss_probe import LossProbe, fake_loss_peak, output_layout

LOGITS = (4, 16, 256)
MIB = 4 * 16 * 256 * 4  # bytes of the float32 logits


def _times_logits(peak: int) -> float:
    """``peak`` in logits, less the scalars (the loss, its gradient)."""
    return (peak - peak % 1024) / MIB


@dataclasses.dataclass
class Output:
    """Not a pytree node: a leaf the probe cannot lay out again."""

    logits: torch.Tensor


def _peak(loss_fn, output: object = None) -> int:
    logits = torch.randn(LOGITS, requires_grad=True)
    layout = output_layout({"logits": logits, "loss": None} if output is None else output)
    assert layout is not None
    return fake_loss_peak(torch.nn.Linear(2, 2), layout, (), {}, loss_fn=loss_fn)


def test_a_squared_loss_holds_five_times_the_logits() -> None:
    """The logits it saved, the gradient of the mean, 2 * logits, the product: five at once
    (not two, one kept tensor and the gradient, as a guess from the loss's output would say)."""
    assert _times_logits(_peak(lambda out: out["logits"].float().square().mean())) == 5


def test_losses_hold_what_they_keep() -> None:
    y = torch.randint(LOGITS[-1], LOGITS[:2])
    assert _times_logits(_peak(lambda out: out["logits"].sum())) == 1  # the gradient only
    cross_entropy = _peak(lambda out: F.cross_entropy(out["logits"].flatten(0, 1), y.flatten()))
    assert _times_logits(cross_entropy) == 3


def test_the_loss_leaves_the_model_and_its_gradients_alone() -> None:
    root = torch.nn.Linear(LOGITS[-1], 1)
    before = root.weight.detach().clone()
    layout = output_layout(torch.randn(LOGITS, requires_grad=True))
    assert layout is not None
    peak = fake_loss_peak(root, layout, (), {}, loss_fn=lambda out: root(out).square().mean())
    assert peak > 0 and root.weight.grad is None and torch.equal(root.weight, before)


def test_outputs_it_cannot_lay_out_leave_the_loss_assumed() -> None:
    assert output_layout(Output(torch.randn(2, 3))) is None
    probe = LossProbe(lambda out: out.logits.sum(), (), {}, "cpu")
    assert probe.saw(Output(torch.randn(2, 3))) is not None
    assert probe.peak(torch.nn.Linear(2, 2)) is None


def test_a_probe_measures_once_the_first_output_it_saw() -> None:
    probe = LossProbe(lambda out: out.float().square().mean(), (), {}, "cpu")
    probe.saw(torch.randn(LOGITS, requires_grad=True))
    probe.saw(torch.randn(1, requires_grad=True))  # a later step's output: not the layout
    peak = probe.peak(torch.nn.Linear(2, 2))
    assert peak is not None and _times_logits(peak) == 5
    assert probe.peak(torch.nn.Linear(2, 2)) == peak
