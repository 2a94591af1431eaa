"""Recompute really happens in training, and never in eval or under no_grad."""

from __future__ import annotations

import copy

import torch
from torch.utils.flop_counter import FlopCounterMode

import fxckpt
from models import MLP, ResNet, gpt2
from support import loss_of, run_step


def _count_segment_calls(tm: fxckpt.TransformedModule) -> dict[str, int]:
    calls: dict[str, int] = {}
    for seg in fxckpt.inspect(tm).plan.segments:
        calls[seg.name] = 0
        sub = fxckpt.inspect(tm).graph_module.get_submodule(seg.name)
        sub.register_forward_pre_hook(
            lambda m, a, name=seg.name: calls.__setitem__(name, calls[name] + 1)
        )
    return calls


def test_each_segment_runs_twice_per_training_step() -> None:
    x = torch.randn(8, 32, requires_grad=True)
    tm = fxckpt.transform(MLP(depth=6), every=2, example_inputs=(x,))
    calls = _count_segment_calls(tm)
    assert len(calls) == 3  # 7 linears in units of 2; the head alone would free nothing
    loss_of(tm(x)).backward()
    assert calls == {name: 2 for name in calls}


def test_recompute_flops_are_exactly_the_plans() -> None:
    """FLOPs of a step = eager FLOPs + the segments' forward FLOPs, counted by PyTorch."""
    model = ResNet()
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    tm = fxckpt.transform(model, every=1, example_inputs=(x,))

    def flops(m: torch.nn.Module) -> int:
        with FlopCounterMode(display=False) as counter:
            loss_of(m(x)).backward()
        return counter.get_total_flops()

    eager, checkpointed = flops(reference), flops(tm)
    assert fxckpt.inspect(tm).plan.recompute_flops > 0
    assert checkpointed - eager == fxckpt.inspect(tm).plan.recompute_flops


def test_eval_and_no_grad_run_the_model_itself() -> None:
    """Promise 4: eval() and no_grad() pay nothing: no segment runs, nothing is captured."""
    x = torch.randn(8, 32)
    tm = fxckpt.transform(MLP(), every=1)
    tm(x)  # plan for training mode
    calls = _count_segment_calls(tm)
    with torch.no_grad():
        out = tm(x)
    assert out.grad_fn is None and set(calls.values()) == {0}

    tm.eval()
    loss_of(tm(x)).backward()
    assert set(calls.values()) == {0}, "eval mode ran the rewritten graph"
    assert fxckpt.inspect(tm).captures == 1


def test_hf_gpt2_recomputes_each_block() -> None:
    ids = torch.randint(0, 64, (2, 12))
    tm = fxckpt.transform(gpt2(layers=3), depth=3, example_inputs=(ids,))
    blocks = [
        s
        for s in fxckpt.inspect(tm).plan.segments
        if s.module_paths[0].startswith("transformer.h.")
    ]
    assert [s.module_paths for s in blocks] == [(f"transformer.h.{i}",) for i in range(3)]
    calls = _count_segment_calls(tm)
    run_step(tm, (ids,), {})
    assert all(calls[s.name] == 2 for s in blocks)
