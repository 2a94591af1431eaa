"""Recompute really happens in training, and never in eval or under no_grad."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch._dynamo as dynamo
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


def _backward_matmuls(keeps: tuple[str, ...]) -> tuple[int, int]:
    """``(addmm/mm in the compiled forward, in the compiled backward)`` of one segment of two
    Linear -> GELU blocks under ``torch.compile``, whose segment keeps ``keeps``."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from fxckpt.runtime.segment import SegmentModule

    dynamo.reset()
    body = torch.fx.symbolic_trace(torch.nn.Sequential(
        torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16), torch.nn.GELU()))
    segment = SegmentModule(body, body.graph, name="segment_0", compiled_keeps=keeps)
    counts: list[int] = []

    def count(gm: torch.fx.GraphModule, _: Any) -> Any:
        counts.append(sum(n.target in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)
                          for n in gm.graph.nodes))
        return make_boxed_func(gm.forward)

    step = torch.compile(lambda x: fxckpt.checkpoint(segment, x),
                         backend=aot_autograd(fw_compiler=count, bw_compiler=count))
    step(torch.randn(8, 16, requires_grad=True)).sum().backward()
    return counts[0], counts[1]


def test_under_compile_a_segment_keeps_its_compiled_keeps_and_recomputes_the_rest() -> None:
    """``compiled_keeps`` is torch's selective-checkpoint policy inside Dynamo's checkpoint op:
    the kept matmuls are not run again in the compiled backward; without it they are."""
    # two linears: forward 2; backward 2 x (input grad, weight grad), plus the recompute
    assert _backward_matmuls(("addmm", "mm")) == (2, 4)
    assert _backward_matmuls(()) == (2, 6)
