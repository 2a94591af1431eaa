"""What a compiled step keeps, asked of AOTAutograd's partitioners; the compiled step's peak."""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch
import torch._dynamo as dynamo
from torch import nn

from fxckpt.errors import VerifyError
from fxckpt.measure import compiled_step
from fxckpt.measure.compiled_step import CompiledPeak, compiled_saved
from fxckpt.measure.loss_probe import fake_loss_peak, output_layout

B, W = 32, 64
ACTIVATION = B * W * 4  # one fp32 activation of the models below


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    dynamo.reset()
    with dynamo.config.patch(suppress_errors=dynamo.config.suppress_errors):
        yield


def _batchnorm_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(W, W), nn.BatchNorm1d(W), nn.ReLU(), nn.Dropout(0.5),
                         nn.Linear(W, W)).train()


def test_the_eager_partition_keeps_what_autograd_keeps_and_the_compiled_one_less() -> None:
    """Linear -> BatchNorm -> ReLU -> Dropout -> Linear. The eager step keeps the first linear's
    output (BatchNorm's input), BatchNorm's two per-channel statistics, ReLU's output, the
    dropout mask (bool) and the dropout's output (the second linear's input); the compiled step
    recomputes the dropout's output from the ReLU's and the mask: one activation less. Inputs
    and weights (and their transposes, views of them) are not counted."""
    model = _batchnorm_mlp()
    saved = compiled_saved(lambda a, k: model(*a), (torch.randn(B, W),), {})
    assert saved.eager == 3 * ACTIVATION + 2 * W * 4 + B * W
    assert saved.compiled == saved.eager - ACTIVATION


@pytest.mark.parametrize("suppress_errors", [False, True])
def test_nothing_runs_nothing_changes(suppress_errors: bool) -> None:
    """The probe stops once the graph is partitioned: BatchNorm's statistics, the random
    generator and the gradients are as they were, and no forward ran; also where the user
    asked Dynamo to run a frame eagerly when its backend fails."""
    dynamo.config.suppress_errors = suppress_errors
    model = _batchnorm_mlp()
    calls: list[int] = []
    model[0].register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(B, W, requires_grad=True)
    state = torch.get_rng_state()
    compiled_saved(lambda a, k: model(*a), (x,), {})
    assert model[1].num_batches_tracked.item() == 0
    assert torch.equal(model[1].running_mean, torch.zeros(W))
    assert torch.equal(torch.get_rng_state(), state)
    assert all(p.grad is None for p in model.parameters())
    assert calls == []  # dynamo traced the hook's module on fake tensors: the hook never ran


def test_a_step_that_cannot_be_traced_says_so() -> None:
    def run(a: tuple, k: dict) -> Any:
        x = a[0] * 2
        return x * float(x.sum().item() > 0) if dynamo.is_compiling() else x

    with pytest.raises(VerifyError, match="no training graph|could not be traced"):
        compiled_saved(run, (torch.randn(3),), {})  # no input wants a gradient


def test_the_compiled_peak_is_what_the_forward_keeps_plus_the_loss() -> None:
    """``CompiledPeak``: the min-cut partition's bytes plus the loss's own peak on the outputs
    (the stand-in loss without ``loss_fn``), the loss measured once; a graph asked again is
    not traced again."""
    gm = torch.fx.symbolic_trace(_batchnorm_mlp())
    x = torch.randn(B, W)
    traced: list[int] = []
    real = compiled_step.compiled_saved

    def counting(*a: Any) -> Any:
        traced.append(1)
        return real(*a)

    peak = CompiledPeak(gm, lambda g, a, k: g(*a), (x,), {}, None, "cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compiled_step, "compiled_saved", counting)
        first, again = peak(gm), peak(gm)
    loss = fake_loss_peak(gm, output_layout(torch.empty(B, W, requires_grad=True)), (x,), {},
                          loss_fn=compiled_step._stand_in, device="cpu")
    assert peak.loss_bytes == loss > 0
    assert first == again == compiled_saved(lambda a, k: gm(*a), (x,), {}).compiled + loss
    assert traced == [1]


def test_the_users_loss_is_the_one_measured() -> None:
    gm = torch.fx.symbolic_trace(_batchnorm_mlp())
    x = torch.randn(B, W)

    def squared(out: torch.Tensor, *_: Any) -> torch.Tensor:  # four copies, and their squares
        return torch.cat([out] * 4).square().mean()

    stand_in = CompiledPeak(gm, lambda g, a, k: g(*a), (x,), {}, None, "cpu")
    users = CompiledPeak(gm, lambda g, a, k: g(*a), (x,), {}, squared, "cpu")
    assert users(gm) - stand_in(gm) == users.loss_bytes - stand_in.loss_bytes > 0
