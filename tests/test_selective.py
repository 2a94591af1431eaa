"""Selective recompute end to end: kept outputs inside segments are bit-exact (dropout masks,
BatchNorm statistics, autocast), really not recomputed (FLOPs), shown in the plan, pinned by op,
saved and replayed."""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import fxckpt
from fxckpt.errors import ConfigError
from tests.models import ResNet
from tests.support import assert_steps_equal, loss_of, run_step


class Blocks(nn.Module):
    """Pre-norm MLP blocks with dropout: matmuls worth keeping, dropout that must replay."""

    def __init__(self, depth: int = 6, width: int = 128) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(),
                          nn.Dropout(0.1), nn.Linear(2 * width, width))
            for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


ADDMM = {"op:aten.addmm": "save"}
"""Keep every matmul inside a segment: on these small blocks the solver finds plans without keeps
(a kept output costs about 100 us of bookkeeping a step,
:data:`fxckpt.cost.bridge.KEEP_COST`, and a segment can end where its recompute stops
before a matmul), so the runtime's keeping is
tested on pinned ones; :func:`test_selective_false_recomputes_whole_segments_and_costs_more` has
the solver choose them."""


def _x() -> torch.Tensor:
    return torch.randn(512, 128, requires_grad=True)  # matmuls worth more than keeping costs


def _kept(tm: torch.nn.Module) -> list[str]:
    return [k for s in fxckpt.inspect(tm).plan.segments for k in s.keeps]


def _step_flops(module: nn.Module, x: torch.Tensor) -> int:
    counter = FlopCounterMode(display=False)
    torch.manual_seed(0)
    with counter:
        loss_of(module(x)).backward()
    return counter.get_total_flops()


def test_a_budget_plan_keeping_matmuls_is_exact_and_does_not_run_them_again() -> None:
    torch.manual_seed(0)
    model, x = Blocks().train(), _x()
    eager = copy.deepcopy(model)
    tm = fxckpt.transform(model, budget=0.7, force=ADDMM, example_inputs=(x,))
    plan = fxckpt.inspect(tm).plan
    kept = [s for s in plan.segments if s.keeps]
    assert kept, str(plan)
    assert all(k == "addmm" for s in kept for k in s.kept_ops)
    assert_steps_equal(run_step(tm, (x,), {}), run_step(eager, (x,), {}))
    # Recompute happened, and only of what the plan says: kept matmuls are not run again (every
    # matmul the recompute would run is kept), while the same segments without keeps run them.
    extra = _step_flops(tm, x.detach().requires_grad_()) - _step_flops(eager, x.detach())
    assert extra == plan.recompute_flops == 0
    bare = fxckpt.transform(copy.deepcopy(eager), plan=dataclasses.replace(
        plan, segments=tuple(dataclasses.replace(s, keeps=()) for s in plan.segments)),
        example_inputs=(x,))
    assert _step_flops(bare, x.detach().requires_grad_()) - _step_flops(eager, x.detach()) \
        == fxckpt.inspect(bare).plan.recompute_flops > 0
    whole = fxckpt.transform(Blocks().train(), every=1, example_inputs=(x,))
    assert fxckpt.inspect(whole).plan.segments  # a plan without keeps recomputes matmuls
    assert plan.verified_peak is not None and plan.verified_peak <= plan.budget_bytes


def test_matmuls_on_3d_inputs_are_kept_not_run_again_and_verified_as_they_run() -> None:
    """``Linear`` on a 3-d input is ``view, mm, _unsafe_view``: the ``mm`` is what is kept (keeping
    the ``_unsafe_view`` left the ``mm`` to run again). And the verified peak on fake tensors is
    the real step's: fake tensors route ``prim.device`` queries through the dispatcher, which once
    made the fake run keep a device instead of the matmul, and count no kept output at all."""
    from fxckpt.measure import LiveTensorTracker

    torch.manual_seed(0)
    model, x = Blocks().train(), torch.randn(4, 128, 128, requires_grad=True)
    eager = copy.deepcopy(model)
    tm = fxckpt.transform(model, every=1, force={"op:aten.addmm": "save"}, example_inputs=(x,),
                          loss_fn=lambda out, *a: out.sum(), verify=True)
    plan = fxckpt.inspect(tm).plan
    assert {k for s in plan.segments for k in s.kept_ops} == {"addmm"}, str(plan)
    extra = _step_flops(tm, x.detach().requires_grad_()) - _step_flops(eager, x.detach())
    # Every matmul is kept: the segments recompute only layer norms, GELUs and adds.
    assert plan.segments and extra == plan.recompute_flops == 0
    assert plan.verified_peak is not None
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    xr = x.detach().requires_grad_()
    xr.grad = torch.zeros_like(xr)
    with LiveTensorTracker() as tracker:
        tm(xr).sum().backward()
    kept = sum(s.kept_bytes for s in plan.segments)
    assert plan.verified_peak == tracker.peak_bytes, (plan.verified_peak, tracker.peak_bytes, kept)


def test_selective_false_recomputes_whole_segments_and_costs_more() -> None:
    """A GPT-2 block's tanh (GELU's approximation, dear per byte) is kept by the solver."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=128, n_head=2, n_positions=64, vocab_size=128,
                     bos_token_id=0, eos_token_id=0, use_cache=False)
    model, x = GPT2LMHeadModel(cfg).train(), torch.randint(128, (4, 64))
    on = fxckpt.inspect(fxckpt.transform(model, budget=0.65, example_inputs=(x,))).plan
    off = fxckpt.inspect(
        fxckpt.transform(model, budget=0.65, selective=False, example_inputs=(x,))).plan
    assert not any(s.keeps for s in off.segments) and any(s.keeps for s in on.segments)
    # the solver's objective: recompute and each segment's overhead (a segment keeping the tanh
    # against one recomputing everything)
    assert on.predicted_recompute < off.predicted_recompute
    assert off.options.get("selective") is False
    points = fxckpt.pareto(model, example_inputs=(x,), points=9)
    whole = fxckpt.pareto(model, example_inputs=(x,), points=9, selective=False)
    assert [p["budget"] for p in points] == [p["budget"] for p in whole]
    assert all(a["recompute"] <= b["recompute"] for a, b in zip(points, whole))


def test_pinned_ops_are_kept_in_every_segment_and_batchnorm_updates_once() -> None:
    torch.manual_seed(0)
    model, x = ResNet().train(), torch.randn(2, 3, 8, 8, requires_grad=True)
    eager = copy.deepcopy(model)
    tm = fxckpt.transform(model, depth=2, force={"op:aten.convolution": "save"},
                          example_inputs=(x,))
    plan = fxckpt.inspect(tm).plan
    convs = [k for s in plan.segments for k in s.kept_ops]
    assert convs and set(convs) == {"convolution"}
    assert not any("convolution" in s.recomputed_ops for s in plan.segments)
    assert_steps_equal(run_step(tm, (x,), {}), run_step(eager, (x,), {}))
    assert_steps_equal(run_step(tm, (x,), {}, seed=3), run_step(eager, (x,), {}, seed=3))


class Casts(nn.Module):
    """An fp32 RMSNorm in bf16 blocks: nodes that are a cast and nothing else."""

    def __init__(self, depth: int = 4, width: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            wide = x.to(torch.float32)
            wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)
            x = x + layer(wide.to(x.dtype)).relu()
        return x


def test_a_kept_cast_is_kept_not_run_again_and_exact() -> None:
    """A node whose only call is a copy (``_to_copy``) keeps that copy's output: before, it
    kept nothing and the first backward through its segment failed as if it were a second."""
    torch.manual_seed(0)
    model = Casts().to(torch.bfloat16).train()
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    eager = copy.deepcopy(model)
    tm = fxckpt.transform(model, every=1, force={"op:aten._to_copy": "save"}, verify=True,
                          example_inputs=(x,))
    plan = fxckpt.inspect(tm).plan
    assert {k for s in plan.segments for k in s.kept_ops} == {"_to_copy"}
    assert plan.verified_peak is not None
    assert_steps_equal(run_step(tm, (x,), {}), run_step(eager, (x,), {}))
    assert_steps_equal(run_step(tm, (x,), {}, seed=2), run_step(eager, (x,), {}, seed=2))


def test_an_op_pinned_to_recompute_is_never_kept() -> None:
    torch.manual_seed(0)
    model, x = Blocks().train(), _x()
    tm = fxckpt.transform(model, budget=0.7, force={"op:aten.addmm": "recompute"},
                          example_inputs=(x,))
    assert _kept(tm) == []


def test_gpt2_with_dropout_keeps_exact_grads_and_never_keeps_random_ops() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=3, n_embd=128, n_head=4, n_positions=64, vocab_size=64,
                     bos_token_id=0, eos_token_id=0, use_cache=False, attn_pdrop=0.1,
                     resid_pdrop=0.1, embd_pdrop=0.1)
    model = GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 64, (4, 64))
    eager = copy.deepcopy(model)
    # addmm pinned (so the test does not hang on the solver's choice); dropout pinned too, and
    # refused: a random op is never kept, or the recompute would draw other masks.
    tm = fxckpt.transform(model, budget=0.6, example_inputs=(ids,), force={
        "op:aten.addmm": "save", "op:aten.bernoulli_": "save", "op:aten.native_dropout": "save"})
    plan = fxckpt.inspect(tm).plan
    kinds = {k for s in plan.segments for k in s.kept_ops}
    assert "addmm" in kinds, str(plan)
    assert not {"bernoulli_", "native_dropout", "dropout", "mul"} & kinds
    assert_steps_equal(run_step(tm, (ids,), {}), run_step(eager, (ids,), {}))


def test_autocast_is_re_entered_for_kept_and_recomputed_ops() -> None:
    torch.manual_seed(0)
    model, x = Blocks().train(), _x()
    eager = copy.deepcopy(model)
    tm = fxckpt.transform(model, force={"op:aten.addmm": "save"}, every=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = run_step(tm, (x,), {})
        b = run_step(eager, (x,), {})
    assert _kept(tm)
    assert_steps_equal(a, b)


def test_the_plan_shows_what_each_segment_keeps_and_recomputes() -> None:
    torch.manual_seed(0)
    tm = fxckpt.transform(Blocks().train(), force={"op:aten.addmm": "save"}, every=2,
                          example_inputs=(_x(),))
    plan = fxckpt.inspect(tm).plan
    text = str(plan)
    assert "kept outputs" in text and "recomputes" in text
    first = plan.segments[0]
    assert first.kept_ops.count("addmm") == len(first.keeps) >= 2
    assert f"addmm x{len(first.keeps)}" in text and "gelu" in text
    assert "output(s) of its ops" in plan.summary() and "selective" in plan.summary()
    assert first.kept_bytes == len(first.keeps) * 64 * 256 * 4 or first.kept_bytes > 0
    assert "kept outputs" in plan._repr_html_()


def test_a_saved_selective_module_and_a_replayed_plan_keep_the_same_calls(tmp_path) -> None:
    torch.manual_seed(0)
    model, x = Blocks().train(), _x()
    eager = copy.deepcopy(model)
    tm = fxckpt.transform(model, budget=0.7, force=ADDMM, example_inputs=(x,))
    plan = fxckpt.inspect(tm).plan
    path = os.path.join(tmp_path, "m")
    fxckpt.save(tm, path)
    loaded = fxckpt.load(path)
    kept = {n: (m.kept, m.code.count("fxckpt_keep_begin("))
            for n, m in fxckpt.inspect(tm).graph_module.named_children()
            if n.startswith("segment")}
    assert sum(k for k, _ in kept.values()) == len(_kept(tm)) > 0
    assert all(k == calls for k, calls in kept.values())
    assert kept == {n: (m.kept, m.code.count("fxckpt_keep_begin("))
                    for n, m in fxckpt.inspect(loaded).graph_module.named_children()
                    if n.startswith("segment")}
    assert_steps_equal(run_step(loaded, (x,), {}), run_step(eager, (x,), {}))
    replayed = fxckpt.transform(copy.deepcopy(eager), plan=plan, example_inputs=(x,))
    assert _kept(replayed) == [k for s in plan.segments for k in s.keeps]


@pytest.mark.parametrize("force, message", [
    ({"op:aten.no_such_op": "save"}, "names no aten op"),
    ({"op:mm": "save"}, "'op:aten.mm'"),
    ({"op:aten.mm": "keep"}, "must be one of"),
])
def test_bad_op_pins_are_refused(force: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        fxckpt.transform(Blocks(), every=1, force=force)


def test_selective_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="selective must be True or False"):
        fxckpt.transform(Blocks(), budget=0.5, selective="yes")  # type: ignore[arg-type]


def test_plot_memory_shades_the_kept_outputs_and_pareto_counts_them() -> None:
    pytest.importorskip("matplotlib")
    from fxckpt.cost.bridge import to_problem
    from fxckpt.cost.runs import keep_positions, spans_of
    from fxckpt.solver.simulate import kept_live
    from fxckpt.viz.common import inspect_module

    torch.manual_seed(0)
    model, x = Blocks().train(), _x()
    tm = fxckpt.transform(model, force={"op:aten.addmm": "save"}, every=2, example_inputs=(x,))
    fig = fxckpt.plot_memory(tm)
    band = next(c for c in fig.axes[0].collections if c.get_gid() == "kept")
    top = max(v[1] for path in band.get_paths() for v in path.vertices)
    seen = inspect_module(tm)
    problem = to_problem(seen.view)
    segs = seen.plan.segments
    live = kept_live(problem, spans_of(problem, [s.nodes for s in segs]),
                     keep_positions(problem, [k for s in segs for k in s.keeps]))
    assert max(live) == sum(s.kept_bytes for s in segs)  # every kept matmul alive at once
    unit = 2**20 if "MiB" in fig.axes[0].get_ylabel() else 2**10
    assert top * unit == pytest.approx(max(live), rel=1e-6)  # the picture is in KiB or MiB


def test_a_second_backward_through_kept_outputs_says_to_use_selective_false() -> None:
    torch.manual_seed(0)
    model, x = Blocks().train(), _x()
    tm = fxckpt.transform(model, force={"op:aten.addmm": "save"}, every=2, example_inputs=(x,))
    loss = loss_of(tm(x))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="selective=False for retain_graph=True"):
        loss.backward()
