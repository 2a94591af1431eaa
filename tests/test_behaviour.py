"""What users try: randomness, modes, autograd APIs, autocast, shared state, re-planning."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import fxckpt
from models import MLP, KwargsDict, Noisy, TrainingFlag
from support import assert_steps_equal, loss_of, run_step


def test_randn_in_forward_is_fresh_each_call() -> None:
    tm = fxckpt.transform(Noisy(), every=1)
    x = torch.zeros(2, 8)
    assert not torch.equal(tm(x), tm(x))
    reference = copy.deepcopy(fxckpt.inspect(tm).model)
    assert_steps_equal(
        run_step(tm, (x.requires_grad_(),), {}, seed=3), run_step(reference, (x,), {}, seed=3)
    )


def test_training_flag_traced_then_eval_behaves_as_eval() -> None:
    model = TrainingFlag()
    tm = fxckpt.transform(model, every=1)
    x = torch.randn(64, 8)
    tm(x)
    tm.eval()
    assert not model.training and not model.fc1.training
    torch.testing.assert_close(tm(x), tm(x))  # no dropout
    with torch.no_grad():
        torch.testing.assert_close(tm(x), model.eval()(x), rtol=0, atol=0)
    tm.train()
    assert not torch.equal(tm(x), tm(x))


def test_autograd_grad_equals_backward_and_double_backward_matches_eager() -> None:
    model = MLP(p=0.0)
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, every=2)
    x = torch.randn(4, 32, requires_grad=True)

    (g_tm,) = torch.autograd.grad(loss_of(tm(x)), x, create_graph=True)
    (g_ref,) = torch.autograd.grad(loss_of(reference(x)), x, create_graph=True)
    assert torch.equal(g_tm, g_ref)
    (gg_tm,) = torch.autograd.grad(g_tm.pow(2).sum(), x)
    (gg_ref,) = torch.autograd.grad(g_ref.pow(2).sum(), x)
    torch.testing.assert_close(gg_tm, gg_ref)


def test_inputs_without_requires_grad_still_give_parameter_grads() -> None:
    tm = fxckpt.transform(MLP(), every=1)
    loss_of(tm(torch.randn(4, 32))).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in tm.parameters())


def test_segments_under_no_grad_make_no_graph() -> None:
    tm = fxckpt.transform(MLP(), every=1)
    x = torch.randn(4, 32, requires_grad=True)
    with torch.no_grad():
        out = tm(x)
    assert not out.requires_grad and out.grad_fn is None


class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


class WithFunction(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(Cube.apply(self.a(x)))


def test_custom_autograd_function_inside_a_segment() -> None:
    model = WithFunction()
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, every=2)
    x = torch.randn(3, 8, requires_grad=True)
    assert_steps_equal(run_step(tm, (x,), {}), run_step(reference, (x,), {}))
    assert fxckpt.inspect(tm).plan.segments


def test_autocast_is_reapplied_during_recompute() -> None:
    model = MLP(p=0.0)
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, every=2)
    x = torch.randn(4, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got_out = tm(x)
    loss_of(got_out).backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_out = reference(x.detach().requires_grad_())
    loss_of(want_out).backward()
    assert got_out.dtype == torch.bfloat16 and torch.equal(got_out, want_out)
    for p, q in zip(tm.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_exception_inside_a_segment_leaves_the_module_usable() -> None:
    tm = fxckpt.transform(MLP(), every=1)
    x = torch.randn(4, 32)
    tm(x)
    with pytest.raises(RuntimeError):
        tm(torch.randn(4, 31))  # wrong width: planning for this signature fails inside a layer
    out = tm(x)
    loss_of(out).backward()
    assert not fxckpt.runtime.is_recomputing()


def test_shares_parameters_buffers_and_state_dict_keys() -> None:
    from models import ResNet

    model = ResNet()
    tm = fxckpt.transform(model, every=1)
    assert list(tm.state_dict()) == list(model.state_dict())
    assert all(p is q for p, q in zip(tm.parameters(), model.parameters()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.fc.weight.detach().clone()
    loss_of(tm(torch.randn(2, 3, 8, 8))).backward()
    opt.step()
    assert not torch.equal(before, tm.fc.weight) and tm.fc.weight is model.fc.weight


def test_new_call_structure_replans_and_a_new_shape_does_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tm = fxckpt.transform(KwargsDict(), every=1, capture="graph")
    x = torch.randn(4, 16)
    with caplog.at_level(logging.INFO, logger="fxckpt"):
        tm(x)
        tm(x)
        out = tm(x, return_hidden=True)
        tm(torch.randn(8, 16))  # another batch size: the symbolic graph serves it as it is
    assert sum("planned KwargsDict" in r.message for r in caplog.records) == 2
    assert fxckpt.inspect(tm).captures == 2 and fxckpt.inspect(tm).plans_made == 2
    assert "hidden" in out and "hidden" not in tm(x)
    assert any("segment_0" in r.message for r in caplog.records)


def test_example_inputs_plan_at_transform_time() -> None:
    x = torch.randn(4, 32)
    tm = fxckpt.transform(MLP(), depth=2, example_inputs=(x,))
    assert [s.module_paths for s in fxckpt.inspect(tm).plan.segments] == [
        (f"layers.{i}",) for i in range(6)
    ]
    assert "fxckpt_checkpoint(segment_0, x)" in fxckpt.inspect(tm).code
    assert fxckpt.Plan.from_dict(fxckpt.inspect(tm).plan.to_dict()) == fxckpt.inspect(tm).plan
    assert "segment_5" in str(fxckpt.inspect(tm).plan)


def test_force_pins_recompute_and_save() -> None:
    x = torch.randn(4, 32)
    tm = fxckpt.transform(MLP(), depth=2, force={"layers.1": "save", "head": "recompute"},
                          example_inputs=(x,))
    paths = [s.module_paths for s in fxckpt.inspect(tm).plan.segments]
    assert ("layers.1",) not in paths and ("layers.0",) in paths
    forced = fxckpt.transform(MLP(), force={"layers.2": "recompute"}, example_inputs=(x,))
    assert [s.module_paths for s in fxckpt.inspect(forced).plan.segments] == [("layers.2",)]
    assert fxckpt.inspect(forced).plan.segments[0].reason == "force: recompute"
