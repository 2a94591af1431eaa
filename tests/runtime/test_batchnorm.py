"""BatchNorm running statistics: deferred per step (pipelines) and restored across recompute.

* :class:`DeferredBatchNorm`: micro-batches normalise with their own statistics, the running
  buffers change once per step, to what one full-batch step would leave, and
  ``num_batches_tracked`` counts steps; a recompute in backward records nothing.
* :func:`fxckpt.runtime.checkpoint.checkpoint`: buffers a segment writes
  (``Recomputable.restores``) are put back for the recompute and set to their after-forward values
  once it is done, so a training step updates them once. The controls without restores show what
  goes wrong.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from fxckpt.runtime.batchnorm import DeferredBatchNorm
from fxckpt.runtime.checkpoint import checkpoint, is_recomputing
from fxckpt.runtime.segment import Recomputable

STATS = ("running_mean", "running_var", "num_batches_tracked")


def batch() -> torch.Tensor:
    return torch.randn(8, 3, 4, 4) * 3 + 1


def stats(bn: nn.Module) -> list[torch.Tensor]:
    return [getattr(bn, name).clone() for name in STATS]


def deferred_step(d: DeferredBatchNorm, bn: nn.Module, x: torch.Tensor,
                  chunks: int) -> list[torch.Tensor]:
    d.begin()
    with d.collecting():
        outs = [bn(c) for c in x.chunk(chunks)]
    d.commit()
    return outs


def test_tracks_only_batchnorm_with_running_statistics() -> None:
    tracked, untracked = nn.BatchNorm2d(3), nn.BatchNorm2d(3, track_running_stats=False)
    model = nn.Sequential(nn.Conv2d(3, 3, 1), tracked, untracked, nn.LayerNorm(4))
    d = DeferredBatchNorm(model.modules())
    assert list(d.norms.values()) == [tracked] and d.active
    assert d.covers(model) and d.covers(tracked)
    assert not d.covers(untracked) and not d.covers(model[0])
    assert not DeferredBatchNorm([untracked, nn.Linear(2, 2)]).active


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_commit_leaves_what_one_full_batch_step_leaves(chunks: int) -> None:
    bn = nn.BatchNorm2d(3, momentum=0.3)
    reference = copy.deepcopy(bn)
    x = batch()
    d = DeferredBatchNorm([bn])
    outs = deferred_step(d, bn, x, chunks)
    reference(x)
    mean, var, count = stats(bn)
    assert torch.allclose(mean, reference.running_mean, atol=1e-6)
    assert torch.allclose(var, reference.running_var, atol=1e-5)
    assert count.item() == 1  # one step, not one per micro-batch
    # Each micro-batch was normalised with its own statistics, as a fresh BatchNorm would.
    for out, c in zip(outs, x.chunk(chunks)):
        assert torch.equal(out, copy.deepcopy(reference).train()(c))


def test_running_buffers_change_only_at_commit() -> None:
    bn = nn.BatchNorm2d(3)
    before = stats(bn)
    d = DeferredBatchNorm([bn])
    d.begin()
    with d.collecting():
        for c in batch().chunk(4):
            bn(c)
    assert torch.equal(bn.running_mean, before[0]) and torch.equal(bn.running_var, before[1])
    assert bn.num_batches_tracked.item() == 4  # the module's own count, fixed by commit
    assert [c for c, _, _ in d.stats[id(bn)]] == [2 * 16] * 4
    d.commit()
    assert bn.num_batches_tracked.item() == 1 and d.stats == {}
    assert not torch.equal(bn.running_mean, before[0])


def test_cumulative_average_when_momentum_is_none() -> None:
    bn = nn.BatchNorm2d(3, momentum=None)
    reference = copy.deepcopy(bn)
    d = DeferredBatchNorm([bn])
    for _ in range(3):
        x = batch()
        deferred_step(d, bn, x, 4)
        reference(x)
    assert torch.allclose(bn.running_mean, reference.running_mean, atol=1e-6)
    assert torch.allclose(bn.running_var, reference.running_var, atol=1e-5)
    assert bn.num_batches_tracked.item() == reference.num_batches_tracked.item() == 3


def test_abort_forgets_the_step() -> None:
    bn = nn.BatchNorm2d(3)
    d = DeferredBatchNorm([bn])
    d.begin()
    with d.collecting():
        bn(batch())
    d.abort()
    d.commit()
    assert torch.equal(bn.running_mean, torch.zeros(3))
    assert torch.equal(bn.running_var, torch.ones(3))


def test_eval_mode_and_untracked_modules_pass_through() -> None:
    tracked, other = nn.BatchNorm2d(3).eval(), nn.BatchNorm2d(3)
    tracked.running_mean.fill_(0.5)
    d = DeferredBatchNorm([tracked])
    d.begin()
    x = batch()
    with d.collecting():
        out = tracked(x)
        other(x)
    assert d.stats == {}
    assert torch.equal(out, copy.deepcopy(tracked)(x))  # normalised with running statistics
    assert not torch.equal(other.running_mean, torch.zeros(3))  # updated at once, as eager


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


def restoring(module: nn.Module, names: tuple[str, ...]) -> nn.Module:
    """``module`` as the runtime sees a segment that writes these buffers (a Recomputable)."""
    module.__class__ = type(f"Recomputable{type(module).__name__}",
                            (type(module), Recomputable), {})
    assert isinstance(module, Recomputable)
    module.name, module.restores = "segment_0", names
    return module


def test_recompute_inside_a_collecting_stage_records_nothing() -> None:
    block = restoring(Block(), tuple(f"bn.{s}" for s in STATS))
    reference = copy.deepcopy(block)
    x = batch()
    d = DeferredBatchNorm([block.bn])
    d.begin()
    with d.collecting():
        outs = [checkpoint(block, c) for c in x.chunk(2)]
        sum(o.sum() for o in outs).backward()  # recomputes each chunk under the mode
    assert len(d.stats[id(block.bn)]) == 2
    d.commit()
    reference(x)
    assert torch.allclose(block.bn.running_mean, reference.bn.running_mean, atol=1e-6)
    assert block.bn.num_batches_tracked.item() == 1


@pytest.mark.parametrize("restores", [True, False], ids=["restored", "control"])
def test_checkpoint_restores_batchnorm_statistics_across_recompute(restores: bool) -> None:
    block = Block()
    reference = copy.deepcopy(block)
    if restores:
        restoring(block, tuple(f"bn.{s}" for s in STATS))
    x = batch()
    checkpoint(block, x.clone().requires_grad_()).sum().backward()
    reference(x).sum().backward()
    same = [torch.equal(a, b) for a, b in zip(stats(block.bn), stats(reference.bn))]
    # Without restores the recompute updates the statistics a second time.
    assert same == ([True, True, True] if restores else [False, False, False])
    assert block.bn.num_batches_tracked.item() == (1 if restores else 2)
    assert torch.equal(block.conv.weight.grad, reference.conv.weight.grad)


class Counter(nn.Module):
    """Reads a buffer, then bumps it: the recompute must read the value the first run read.

    (It multiplies by a copy: saving the buffer itself and then writing it in place would make
    eager backward fail. torch's checkpoint stops recomputing once the last saved tensor is
    back, so the recompute never reaches ``add_``.)
    """

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("step", torch.tensor(1.0))
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(is_recomputing())
        y = x * self.step.clone()
        self.step.add_(1)
        return y


@pytest.mark.parametrize("restores", [True, False], ids=["restored", "control"])
def test_recompute_reads_the_buffers_from_before_the_forward(restores: bool) -> None:
    counter = restoring(Counter(), ("step",) if restores else ())
    x = torch.ones(3, requires_grad=True)
    y = checkpoint(counter, x)
    assert torch.equal(y, x.detach()) and counter.step.item() == 2
    y.sum().backward()
    assert counter.seen == [False, True]
    assert torch.equal(x.grad, torch.full((3,), 1.0 if restores else 2.0))
    assert counter.step.item() == 2


def test_each_retained_backward_recomputes_from_the_same_values() -> None:
    block = restoring(Block(), tuple(f"bn.{s}" for s in STATS))
    reference = copy.deepcopy(block)
    x = batch()
    out = checkpoint(block, x).sum()
    out.backward(retain_graph=True)
    first = block.conv.weight.grad.clone()
    out.backward()
    reference(x)
    assert torch.equal(block.conv.weight.grad, 2 * first)
    assert all(torch.equal(a, b) for a, b in zip(stats(block.bn), stats(reference.bn)))


def test_eval_or_no_grad_calls_the_segment_once() -> None:
    counter = restoring(Counter(), ("step",))
    with torch.no_grad():
        checkpoint(counter, torch.ones(2, requires_grad=True))
    counter.eval()
    checkpoint(counter, torch.ones(2, requires_grad=True))
    assert counter.seen == [False, False] and counter.step.item() == 3
