"""Same bits or a clear refusal: every way a captured graph can diverge from the model.

Each pattern of ``tests/patterns.py`` runs eager and transformed for two training steps with every
strategy; outputs, input grads, every parameter grad and every buffer must be bit-identical, the
modules' modes untouched, and hooks must fire once per forward — or the transform must refuse
with the documented error, leaving the model as it was.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxckpt
from patterns import PATTERNS, Pattern, Stack
from support import assert_steps_equal, loss_of, run_step

# the last: a plan made for a GPU whose segments may offload beside the compute
# (planning/overlap.py), run here; a 1 TB/s link gives it room to offload, and every storage
# moves however small
STRATEGIES = [{}, {"every": 1}, {"every": 2}, {"depth": None}, {"budget": None},
              {"budget": None, "offload": "auto", "device_profile": "h100",
               "offload_device": "cpu", "offload_bandwidth": 1e12, "offload_threshold": 0}]


def _strategy(pattern: Pattern, strategy: dict) -> dict:
    if "depth" in strategy:
        return {"depth": pattern.depth}
    return {**strategy, "budget": pattern.budget} if "budget" in strategy else strategy


def _made(pattern: Pattern) -> nn.Module:
    torch.manual_seed(0)  # the same weights every time: hooks make deepcopy share their log
    return pattern.make()


def _state(model: nn.Module) -> tuple:
    modes = tuple(m.training for m in model.modules())
    return modes, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "pattern,strategy",
    [
        pytest.param(p, s, id=f"{p.name}-{'-'.join(s) or 'none'}")
        for p in PATTERNS
        for s in STRATEGIES
    ],
)
def test_same_bits_or_documented_error(pattern: Pattern, strategy: dict) -> None:
    model, reference = _made(pattern), _made(pattern)
    tm = fxckpt.transform(model, **_strategy(pattern, strategy), capture="graph")
    args, kwargs = pattern.inputs()
    if pattern.error is not None:
        before = _state(model)
        with pytest.raises(pattern.error[0], match=pattern.error[1]):
            tm(*args, **kwargs)
        after = _state(model)
        assert before[0] == after[0] and all(
            torch.equal(before[1][k], after[1][k]) for k in before[1]
        )
        return
    for step in range(2):
        assert_steps_equal(
            run_step(tm, args, kwargs, seed=step), run_step(reference, args, kwargs, seed=step)
        )
    assert [m.training for m in model.modules()] == [m.training for m in reference.modules()]
    # the plan was run on fake tensors (weight_norm's hook included); not when it offloads to
    # the device it runs on (the CPU here): a tracker there would see nothing move
    if "budget" in strategy and "offload" not in strategy:
        assert fxckpt.inspect(tm).plan.verified_peak is not None, fxckpt.inspect(tm).plan.notes
    offloaded = [s for s in fxckpt.inspect(tm).plan.segments if s.action == "offload"]
    if "offload" in strategy and offloaded:  # the copies ran (10 of the 13 patterns offload)
        assert fxckpt.inspect(tm).offload_stats.bytes_moved > 0
    if hasattr(model, "hook_log"):
        assert model.hook_log.calls == reference.hook_log.calls
        assert set(model.hook_log.calls.values()) == {2}, model.hook_log.calls


def test_custom_backward_is_the_one_that_runs() -> None:
    """Autograd of round() is zero; the straight-through estimator passes gradients on."""
    pattern = next(p for p in PATTERNS if p.name == "custom_function_export")
    tm = fxckpt.transform(_made(pattern), every=1, capture="graph")
    loss_of(tm(torch.randn(4, 16))).backward()
    assert tm.inner.blocks[0].fc.weight.grad.abs().sum() > 0
    assert fxckpt.inspect(tm).plan.capture == "export"


def test_forced_leaf_module_becomes_a_segment_and_recomputes() -> None:
    pattern = next(p for p in PATTERNS if p.name == "transformer_encoder_layers")
    x = torch.randn(2, 6, 16)
    tm = fxckpt.transform(_made(pattern), force={"layers.2": "recompute"}, example_inputs=(x,),
        capture="graph")
    plan = fxckpt.inspect(tm).plan
    assert [s.module_paths for s in plan.segments] == [("layers.2",)]
    assert plan.segments[0].freed_bytes > 0  # what the leaf saves inside for backward
    depth = fxckpt.transform(_made(pattern), depth=2, example_inputs=(x,), capture="graph")
    assert len(fxckpt.inspect(depth).plan.segments) == 4


def test_a_force_that_cannot_apply_says_why() -> None:
    x = torch.randn(4, 16)
    tm = fxckpt.transform(Stack(), force={"head": "recompute"}, example_inputs=(x,),
        capture="graph")
    plan = fxckpt.inspect(tm).plan
    assert not plan.segments
    assert any("force['head'] = 'recompute' has no effect" in n for n in plan.notes)


def test_hooked_module_stays_out_of_segments_and_the_plan_says_so() -> None:
    pattern = next(p for p in PATTERNS if p.name == "hooks")
    tm = fxckpt.transform(_made(pattern), depth=2, example_inputs=(torch.randn(4, 16),),
        capture="graph")
    plan = fxckpt.inspect(tm).plan
    assert ("blocks.1",) not in [s.module_paths for s in plan.segments]
    assert any("blocks.1 has hooks" in n for n in plan.notes)


def test_a_mode_set_by_the_user_survives_planning() -> None:
    pattern = next(p for p in PATTERNS if p.name == "frozen_submodule")
    model = _made(pattern)
    tm = fxckpt.transform(model, every=1, example_inputs=(torch.randn(2, 3, 8, 8),),
        capture="graph")
    tm(torch.randn(2, 3, 8, 8))
    assert not model.stem.training and not model.stem[1].training and model.body.training


def test_first_call_under_no_grad_does_not_plan_training() -> None:
    model, reference = Stack(), None
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, every=1, capture="graph")
    x = torch.randn(4, 16)
    with torch.no_grad():
        tm(x)
    assert fxckpt.inspect(tm).captures == 0
    assert_steps_equal(run_step(tm, (x,), {}), run_step(reference, (x,), {}))
    assert fxckpt.inspect(tm).plan.segments


def test_autocast_gets_its_own_graph_and_the_same_bits() -> None:
    model = Stack()
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, every=1, capture="graph")
    x = torch.randn(4, 16)
    tm(x)
    for module in (tm, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x)
        loss_of(out).backward()
    assert fxckpt.inspect(tm).captures == 2 and out.dtype == torch.bfloat16
    for (name, p), q in zip(tm.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name


class WithOptions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Stack()

    def forward(self, x: torch.Tensor, options: object = None) -> torch.Tensor:
        scale = options["scale"] if isinstance(options, dict) else getattr(options, "scale", 1.0)
        return self.body(x) * scale


class Options:
    scale = 2.0


def test_a_mutable_argument_is_refused_by_name() -> None:
    tm = fxckpt.transform(WithOptions(), every=1, capture="graph")
    with pytest.raises(fxckpt.InputError, match=r"keyword argument 'options' is a Options object"):
        tm(torch.randn(4, 16), options=Options())


def test_argument_values_are_keys_so_a_changed_value_is_a_new_graph() -> None:
    model = WithOptions()
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, every=1, capture="graph")
    x = torch.randn(4, 16)
    for scale in (2.0, 3.0, 2.0):
        opts = {"scale": scale}
        assert torch.equal(tm(x, options=opts), reference(x, options=opts))
    assert fxckpt.inspect(tm).captures == 2


def test_global_module_hooks_are_refused() -> None:
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        tm = fxckpt.transform(Stack(), every=1, capture="graph")
        with pytest.raises(
            fxckpt.CaptureError, match="global module forward hooks are registered"
        ):
            tm(torch.randn(4, 16))
    finally:
        handle.remove()


def test_the_users_saved_tensors_hooks_still_fire_and_compose() -> None:
    """A user's saved_tensors_hooks around the step see what is saved outside segments; same
    bits."""
    model = Stack()
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, depth=2, capture="graph")
    x = torch.randn(4, 16, requires_grad=True)
    packed = {"tm": 0, "ref": 0}

    def step(module: nn.Module, name: str) -> list[torch.Tensor]:
        def pack(t: torch.Tensor) -> torch.Tensor:
            packed[name] += 1
            return t * 1  # a copy: unpack must hand back what was packed

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_of(module(x)).backward()
        return [p.grad.clone() for p in module.parameters()]

    got, want = step(tm, "tm"), step(reference, "ref")
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert 0 < packed["tm"] < packed["ref"]  # segments keep their insides out of the user's hooks


@pytest.mark.slow
def test_hooks_on_a_hugging_face_block_fire_once_per_forward() -> None:
    from models import gpt2

    model = gpt2(layers=2)
    reference = copy.deepcopy(model)
    calls = {"tm": 0, "ref": 0}
    model.transformer.h[1].register_forward_hook(
        lambda m, a, o: calls.__setitem__("tm", calls["tm"] + 1)
    )
    reference.transformer.h[1].register_forward_hook(
        lambda m, a, o: calls.__setitem__("ref", calls["ref"] + 1)
    )
    tm = fxckpt.transform(model, depth=3, capture="graph")
    ids = torch.randint(0, 64, (2, 12))
    for step in range(2):
        assert_steps_equal(
            run_step(tm, (ids,), {}, seed=step), run_step(reference, (ids,), {}, seed=step)
        )
    assert calls == {"tm": 2, "ref": 2}
    plan = fxckpt.inspect(tm).plan
    assert plan.capture == "export" and any("transformer.h.1 has hooks" in n for n in plan.notes)
    assert ("transformer.h.0",) in [s.module_paths for s in plan.segments]
