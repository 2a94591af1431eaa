"""Training-loop habits around a module transformed with ``capture="dynamo"``.

What the loop does to the module (rather than what its forward does): per-sample gradients
through ``torch.func``, global module hooks, pruning under a budget in bytes, FLOP counting. Each
is compared with the untouched model, and the recompute is proved by counting FLOPs.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

import fxckpt
from python_patterns import W, Body
from test_driver import Broken


def _backward_flops(module: nn.Module, x: torch.Tensor) -> int:
    loss = module(x).square().mean()
    with FlopCounterMode(display=False) as counter:  # Dynamo skips frames under such a mode
        loss.backward()
    return counter.get_total_flops()


def test_the_recompute_flops_of_every_graph_are_the_plans() -> None:
    """FLOPs of a backward through two graphs = the model's + each graph's planned recompute
    (counted around backward: under a dispatch mode Dynamo runs the forward uncompiled)."""
    torch.manual_seed(0)
    model = Broken()
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, capture="dynamo", every=1)
    x = torch.randn(16, W, requires_grad=True)
    tm(x).sum().backward()  # compiles and plans both graphs
    graphs = fxckpt.inspect(tm).graphs
    planned = sum(g.plan.recompute_flops for g in graphs)
    assert len(graphs) == 2 and all(g.plan.recompute_flops > 0 for g in graphs)
    assert _backward_flops(tm, x) - _backward_flops(reference, x) == planned


def test_per_sample_gradients_through_vmap_grad_functional_call(
        caplog: pytest.LogCaptureFixture) -> None:
    """``vmap(grad(functional_call(tm, ...)))``: Dynamo does not compile under torch.func
    transforms, so the model's own forward runs (unplanned, said once) and gives the model's
    per-sample gradients."""
    torch.manual_seed(0)
    model = Body()
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, capture="dynamo", every=1)
    x = torch.randn(6, W)
    tm(x).sum().backward()  # a training step first: the module has a plan

    def per_sample(module: nn.Module) -> dict[str, torch.Tensor]:
        params = {k: v.detach() for k, v in module.named_parameters()}

        def loss(p: dict[str, torch.Tensor], row: torch.Tensor) -> torch.Tensor:
            out = torch.func.functional_call(module, p, (row.unsqueeze(0),))
            return out.square().mean()
        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)

    with caplog.at_level("WARNING", logger="fxckpt.serve.dynamo.driver"):
        ours, ours_again, theirs = per_sample(tm), per_sample(tm), per_sample(reference)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) and torch.equal(ours_again[k], theirs[k])
               for k in ours)
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and "ran under torch.func transforms" in said[0], said


def test_pruned_weights_under_a_byte_budget_the_step_fits_get_real_gradients() -> None:
    """The probe's worst case: pruning hooks under a byte budget wrote fake tensors into
    ``weight_orig.grad``. Through Dynamo nothing runs the user's forward on fake tensors."""
    import torch.nn.utils.prune as prune

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(W, 2 * W), nn.GELU(), nn.Linear(2 * W, W))
    prune.l1_unstructured(model[0], "weight", amount=0.3)
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(W, 2 * W), nn.GELU(), nn.Linear(2 * W, W))
    prune.l1_unstructured(reference[0], "weight", amount=0.3)
    tm = fxckpt.transform(model, capture="dynamo", budget="1GiB")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (tm, reference)]
    for step in range(3):
        x = torch.randn(8, W)
        for module, opt in zip((tm, reference), optimizers):
            module(x).square().mean().backward()
            grad = module[0].weight_orig.grad
            assert type(grad) is torch.Tensor  # a real tensor, not a fake one
            opt.step()
            opt.zero_grad(set_to_none=False)
        assert torch.equal(model[0].weight_orig, reference[0].weight_orig), step
        assert torch.equal(model[0].weight, reference[0].weight), step


def test_a_global_module_forward_hook_sees_the_real_values_each_call() -> None:
    """``register_module_forward_hook``: Dynamo runs it as Python between graphs or traces it
    into them; either way it sees each call's real outputs, as it does in the model."""
    seen: list[tuple[str, float]] = []

    def hook(module: nn.Module, args: Any, out: Any) -> None:
        if isinstance(module, nn.Linear):
            seen.append((type(module).__name__, float(out.detach().abs().sum())))

    torch.manual_seed(0)
    model = Body(depth=2)
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, capture="dynamo", every=1)
    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        logs = []
        for module in (tm, reference, tm, reference):
            seen.clear()
            module(torch.ones(4, W)).sum().backward()
            logs.append(list(seen))
    finally:
        handle.remove()
    assert logs[0] == logs[1] and logs[2] == logs[3] and len(logs[0]) == 4
    assert len(fxckpt.inspect(tm).graphs) >= 1


def test_a_call_under_a_dispatch_mode_runs_the_model_unplanned_and_says_why_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """Dynamo does not compile under a user's TorchDispatchMode (a FLOP counter, a memory
    tracker): the call is the model's own, exact, and the warning names the mode."""
    torch.manual_seed(0)
    model = Body()
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, capture="dynamo", every=1)
    x = torch.randn(8, W)
    tm(x).sum().backward()
    with caplog.at_level("WARNING", logger="fxckpt.serve.dynamo.driver"):
        for _ in range(2):
            with FlopCounterMode(display=False) as counter:
                tm(x).square().mean().backward()
            ours = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        reference(x).square().mean().backward()
    assert ours == counter.get_total_flops()  # nothing recomputed: unplanned
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and "TorchDispatchMode (_FlopCounterMode)" in said[0], said
    assert "around backward" in said[0]


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torch_compile_around_the_module_keeps_the_plan_and_says_it_adds_nothing(
        backend: str, caplog: pytest.LogCaptureFixture) -> None:
    """``torch.compile(tm)``: the outer compile breaks at fxckpt's driver (which compiles the
    forward itself), so every step runs the plan, bit-exact, and one warning says why."""
    torch.manual_seed(0)
    model = Body()
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, capture="dynamo", every=1)
    compiled = torch.compile(tm, backend=backend)
    with caplog.at_level("WARNING", logger="fxckpt.serve.dynamo.driver"):
        for step in range(3):
            x = torch.randn(8, W)
            ours, theirs = compiled(x), reference(x)
            ours.square().mean().backward()
            theirs.square().mean().backward()
            assert torch.equal(ours, theirs), step
            assert [g.index for g in fxckpt.inspect(tm).graphs] == [0], step
            assert len(fxckpt.inspect(tm).plan.segments) >= 3
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and "compiles nothing more" in said[0], said
