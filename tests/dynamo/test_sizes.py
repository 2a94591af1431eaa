"""Plans by size on the default path (fxckpt/serve/dynamo/sized.py): after a call with new
sizes Dynamo serves every size with one dynamic graph, and a budget in bytes must still hold at
each; a growing batch is planned by power-of-two buckets, as a whole graph's calls are."""

from __future__ import annotations

import logging
from typing import Callable, Iterable

import pytest
import torch
import torch.nn as nn

import fxckpt
from fxckpt.measure.tracker import LiveTensorTracker
from models import bert, gpt2


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(8)])


def _tracked(module: nn.Module, args: tuple) -> int:
    """The step's peak, tracked as it runs (under Dynamo), with a loss that holds no more than
    the plans' stand-in (a loss that holds more needs loss_fn=: docs/standin.md)."""
    with LiveTensorTracker() as tracker:
        out = module(*args)
        out = out.logits if hasattr(out, "logits") else out
        out.sum().backward()
    return tracker.peak_bytes


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in module.named_parameters() if p.grad is not None}


def _steps_alike(tm: nn.Module, reference: nn.Module, calls: Iterable[tuple[int, tuple]],
                 step: Callable[[nn.Module, tuple], int], budget: int) -> None:
    """Each ``(seed, args)`` call through both modules from the same seed (the same dropout
    masks): ``tm``'s step peak within 1.05 of ``budget``, every gradient the reference's."""
    for seed, args in calls:
        tm.zero_grad(), reference.zero_grad()
        torch.manual_seed(seed)
        peak = step(tm, args)
        assert peak <= 1.05 * budget, (seed, peak, budget)
        torch.manual_seed(seed)
        step(reference, args)
        ours, theirs = _params(tm), _params(reference)
        assert ours.keys() == theirs.keys(), seed
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs), seed


@pytest.mark.parametrize("model,inputs", [
    (_mlp, lambda n: (torch.randn(n, 64),)),
    (lambda: gpt2(layers=4), lambda n: (torch.randint(0, 64, (2, n // 32)),)),
], ids=["mlp", "gpt2"])
def test_each_size_of_a_growing_and_shrinking_batch_holds_a_budget_in_bytes(model, inputs) -> None:
    sizes = [128, 256, 512, 384, 1024, 640, 1024, 256]
    largest = max(sizes)
    torch.manual_seed(0)
    eager = _tracked(model(), inputs(largest))
    budget = int(0.7 * eager)
    torch.manual_seed(0)
    tm = fxckpt.transform(model(), budget=budget)
    torch.manual_seed(0)
    reference = model()
    _steps_alike(tm, reference, ((step, inputs(n)) for step, n in enumerate(sizes)), _tracked,
                 budget)
    plans = fxckpt.inspect(tm).plans
    # one plan per new largest size at most (128, 256, 512, 1024); the rest reuse a larger one
    assert len(plans) <= 4, [p.summary() for p in plans]
    assert any(p.segments for p in plans)


def test_every_and_depth_plans_do_not_depend_on_sizes() -> None:
    tm = fxckpt.transform(_mlp(), every=2)
    for n in (8, 16, 32, 64):
        tm(torch.randn(n, 64)).sum().backward()
    assert len(fxckpt.inspect(tm).plans) == 2  # the static graph, then Dynamo's dynamic one


class _SizedFromShapes(nn.Module):
    """Sizes read in Python (a position ramp over the batch, a reshape by it): Dynamo passes
    the batch as an integer input beside the tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Tanh())
                                    for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.arange(x.shape[0], dtype=x.dtype).unsqueeze(1) / x.shape[0]
        for block in self.blocks:
            x = block(x)
        return x.reshape(x.shape[0], 8, 8).sum(-1)


class _BreaksMidway(_SizedFromShapes):
    """Two graphs: the second is planned beside what the first keeps, at the call's sizes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks[:4]:
            x = block(x)
        torch._dynamo.graph_break()
        for block in self.blocks[4:]:
            x = block(x)
        return x


@pytest.mark.parametrize("cls,budget,most", [(_SizedFromShapes, 1_800_000, 6),
                                             (_BreaksMidway, 3_200_000, None)],
                         ids=["one_graph", "graph_break"])
def test_a_batch_growing_every_step_is_planned_by_buckets_not_at_every_size(
        cls: type, budget: int, most: int) -> None:
    """Planned at power-of-two buckets, the budget held at every size. With a break, the
    second graph is planned beside what the first keeps at the sizes it was checked at."""
    torch.manual_seed(0)
    tm = fxckpt.transform(cls(), budget=budget)
    torch.manual_seed(0)
    reference = cls()
    sizes = range(200, 1200, 25)  # 40 sizes, each larger than the last
    _steps_alike(tm, reference, ((n, (torch.randn(n, 64),)) for n in sizes), _tracked, budget)
    plans = fxckpt.inspect(tm).plans
    assert any(p.segments for p in plans)
    if most is not None:
        # the first size (a static graph), then the dynamic graph at 225, checked or planned
        # at the buckets 256, 512, 1024 and 2048 at most: not one plan per size (40)
        assert len(plans) <= most, [p.summary() for p in plans]


def test_bucketed_placeholders_set_each_size_input_to_its_padded_dimension() -> None:
    from fxckpt.serve.dynamo.sized import size_inputs

    graphs = []

    def keep(gm: torch.fx.GraphModule, inputs: list) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    model = _SizedFromShapes()
    compiled = torch.compile(model, backend=keep, dynamic=True)
    compiled(torch.randn(5, 64))
    gm = graphs[-1]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sizes = size_inputs(gm)
    assert sizes, [n.meta.get("example_value") for n in placeholders]
    tensors = [n for n in placeholders if isinstance(n.meta["example_value"], torch.Tensor)]
    for position, (tensor, dim) in sizes.items():
        symbol = placeholders[position].meta["example_value"]
        assert str(tensors[tensor].meta["example_value"].shape[dim]) == str(symbol)


def test_a_hugging_face_model_with_its_loss_after_a_break_is_planned_by_buckets() -> None:
    """GPT-2 with labels: Hugging Face's loss logs a warning, so Dynamo runs it as a second
    graph. Each graph's plans are checked at buckets; the loss graph is planned beside what the
    first graph keeps at the sizes its plan was checked at (at least the call's)."""
    def step(module: nn.Module, args: tuple) -> int:
        with LiveTensorTracker() as tracker:
            module(*args, labels=args[0]).loss.backward()
        return tracker.peak_bytes

    torch.manual_seed(0)
    budget = int(0.5 * step(gpt2(layers=4), (torch.randint(0, 64, (24, 32)),)))
    torch.manual_seed(0)
    tm = fxckpt.transform(gpt2(layers=4), budget=budget)
    torch.manual_seed(0)
    reference = gpt2(layers=4)
    calls = ((batch, (torch.randint(0, 64, (batch, 32)),)) for batch in range(1, 25))
    _steps_alike(tm, reference, calls, step, budget)
    info = fxckpt.inspect(tm)
    assert len(info.graphs) == 2
    assert any(p.segments for p in info.plans)
    assert len(info.plans) <= 8, [p.summary() for p in info.plans]  # not 2 per size (48)


def test_sizes_the_model_refuses_at_a_bucket_are_planned_as_they_come_quietly(caplog) -> None:
    """BERT with 32 positions: a bucket past them fails in a meta kernel (its token-type buffer
    expanded to the bucket), which torch logs at ERROR. The cache plans the call's own sizes
    instead, with nothing logged at ERROR."""
    def step(module: nn.Module, args: tuple) -> int:
        with LiveTensorTracker() as tracker:
            module(*args).last_hidden_state.square().mean().backward()
        return tracker.peak_bytes

    caplog.set_level(logging.ERROR)
    torch.manual_seed(0)
    budget = int(0.6 * step(bert(layers=2), (torch.randint(0, 64, (4, 32)),)))
    torch.manual_seed(0)
    tm = fxckpt.transform(bert(layers=2), budget=budget)
    torch.manual_seed(0)
    reference = bert(layers=2)
    calls = ((n, (torch.randint(0, 64, (4, n)),)) for n in range(6, 33, 2))
    _steps_alike(tm, reference, calls, step, budget)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-2000:]
