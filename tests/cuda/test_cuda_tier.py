"""The CUDA tier: what users need proven on a GPU, run wherever one is present (skipped
otherwise). ``scripts/gpu_check.sh`` runs every test marked ``cuda`` (``pytest -m cuda``).

Exactness on CUDA (dropout replays CUDA generator states; BatchNorm statistics update once;
selective keeps; autocast bf16; model-owned CUDA generators; RReLU), offload to pinned host
memory (a second backward with ``retain_graph``, no memory growth over 100 steps), two pipeline
stages on one GPU, the verified peak of a budget plan against ``max_memory_allocated``, and
``torch.compile(tm)`` with inductor.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxckpt
from models import MLP, ResNet, gpt2
from support import assert_steps_equal, loss_of, run_step

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE = "cuda"
STRATEGIES = [{"every": 1}, {"every": 2}, {"depth": 2}, {"budget": 0.5}]


def _pair(make, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    model = make().to(DEVICE)
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: "-".join(map(str, s.items())))
def test_every_strategy_is_exact_with_dropout(strategy: dict) -> None:
    model, reference = _pair(lambda: MLP(depth=6, width=256, p=0.2))
    tm = fxckpt.transform(model, **strategy)
    x = torch.randn(64, 256, device=DEVICE, requires_grad=True)
    for step in range(3):
        assert_steps_equal(run_step(tm, (x,), {}, seed=step),
                           run_step(reference, (x,), {}, seed=step))
    assert fxckpt.inspect(tm).plan.segments


def test_batchnorm_statistics_update_once_per_step() -> None:
    model, reference = _pair(lambda: ResNet())
    tm = fxckpt.transform(model, every=1)
    x = torch.randn(8, 3, 32, 32, device=DEVICE)
    for step in range(2):
        assert_steps_equal(run_step(tm, (x,), {}, seed=step),
                           run_step(reference, (x,), {}, seed=step))


def test_selective_keeps_are_exact() -> None:
    model, reference = _pair(lambda: gpt2(layers=4))
    ids = torch.randint(0, 64, (4, 64), device=DEVICE)
    # GPT-2's projections run as addmm: keep them, recompute the rest (a selective plan)
    tm = fxckpt.transform(model, every=1, force={"op:aten.addmm": "save"}, example_inputs=(ids,))
    assert any(s.keeps for s in fxckpt.inspect(tm).plan.segments), "no selective keeps"
    for step in range(2):
        assert_steps_equal(run_step(tm, (ids,), {}, seed=step),
                           run_step(reference, (ids,), {}, seed=step))


@pytest.mark.parametrize("strategy", [{"every": 1}, {"budget": 0.5}], ids=["every", "budget"])
def test_autocast_bf16_is_exact(strategy: dict) -> None:
    model, reference = _pair(lambda: MLP(depth=4, width=256, p=0.1))
    tm = fxckpt.transform(model, **strategy)
    x = torch.randn(64, 256, device=DEVICE)
    for module in (tm, reference):
        torch.manual_seed(0)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            out = module(x)
        loss_of(out).backward()
    for (name, p), q in zip(tm.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name


class Island(nn.Module):
    """A no_grad island, noise from a CUDA generator the model owns, and RReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 256)
        self.act = nn.RReLU()
        self.gen = torch.Generator(device=DEVICE).manual_seed(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.a(x + 0.1 * torch.randn(x.shape, device=x.device, generator=self.gen)))
        with torch.no_grad():
            gate = torch.sigmoid(self.b(h))
        return self.c(h * gate)


@pytest.mark.parametrize("strategy", [{"every": 1}, {"depth": 1}], ids=["every", "depth"])
def test_python_facts_are_kept_on_cuda(strategy: dict) -> None:
    model, reference = _pair(Island)
    tm = fxckpt.transform(model, **strategy)
    x = torch.randn(32, 256, device=DEVICE, requires_grad=True)
    for step in range(3):
        assert_steps_equal(run_step(tm, (x,), {}, seed=step),
                           run_step(reference, (x,), {}, seed=step))
    assert torch.equal(model.gen.get_state(), reference.gen.get_state())


def test_offload_to_pinned_memory_retains_the_graph_and_does_not_leak() -> None:
    model, reference = _pair(lambda: MLP(depth=4, width=512, p=0.0))
    tm = fxckpt.transform(model, every=1, offload=True, offload_threshold=0)
    x = torch.randn(128, 512, device=DEVICE, requires_grad=True)
    for module in (tm, reference):  # a second backward through the same graph
        out = loss_of(module(x))
        out.backward(retain_graph=True)
        out.backward()
    for (name, p), q in zip(tm.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    torch.cuda.synchronize()
    after = []
    for step in range(100):
        tm.zero_grad(set_to_none=True)
        loss_of(tm(x)).backward()
        if step in (9, 99):
            torch.cuda.synchronize()
            after.append(torch.cuda.memory_allocated())
    assert after[1] <= after[0], f"device memory grew from {after[0]} to {after[1]} bytes"
    pool = fxckpt.module.dispatcher_of(tm).offloader.pool
    assert pool.pin and all(b.is_pinned() for bs in pool.free.values() for b in bs)


def test_two_pipeline_stages_on_one_gpu() -> None:
    model, reference = _pair(lambda: MLP(depth=6, width=256, p=0.0))
    tm = fxckpt.transform(model, depth=2, chunks=4, devices=[DEVICE, DEVICE])
    x = torch.randn(64, 256, device=DEVICE)
    got, want = run_step(tm, (x,), {}), run_step(reference, (x,), {})
    for a, b in zip(got.out, want.out):
        torch.testing.assert_close(a, b)
    for name in got.param_grads:
        torch.testing.assert_close(got.param_grads[name], want.param_grads[name])


def test_the_verified_peak_is_within_5_percent_of_max_memory_allocated() -> None:
    model = gpt2(layers=6).to(DEVICE)
    ids = torch.randint(0, 64, (8, 256), device=DEVICE)
    tm = fxckpt.transform(model, budget=0.5, example_inputs=(ids,))
    plan = fxckpt.inspect(tm).plan
    assert plan.verified_peak is not None
    loss_of(tm(ids)).backward()  # warm-up: gradients and the allocator's blocks
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss_of(tm(ids)).backward()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - before
    assert abs(plan.peak_bytes / measured - 1) <= 0.05, (plan.peak_bytes, measured)
    assert measured <= 1.02 * plan.budget_bytes


def test_torch_compile_with_inductor() -> None:
    model, reference = _pair(lambda: MLP(depth=4, width=256, p=0.0))
    tm = fxckpt.transform(model, every=1)
    compiled = torch.compile(tm)
    x = torch.randn(64, 256, device=DEVICE)
    got, want = run_step(compiled, (x,), {}), run_step(reference, (x,), {})
    for a, b in zip(got.out, want.out):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    for name in want.param_grads:
        torch.testing.assert_close(got.param_grads[f"_orig_mod.{name}"],
                                   want.param_grads[name], rtol=1e-3, atol=1e-3)


def test_a_gpu_model_refines_its_measured_prices_after_the_timed_steps() -> None:
    """On the GPU the segments are timed by CUDA events (no synchronisation in the step), the
    factor compared with the measured profile's prices, and the bits stay eager's."""
    from fxckpt.serve.refine import TIMED, WARMUP

    model, reference = _pair(lambda: MLP(depth=8, width=1024, p=0.1))
    tm = fxckpt.transform(model, budget=0.5)
    x = torch.randn(256, 1024, device=DEVICE, requires_grad=True)
    for step in range(WARMUP + TIMED + 2):
        assert_steps_equal(run_step(tm, (x,), {}, seed=step),
                           run_step(reference, (x,), {}, seed=step))
    result = fxckpt.inspect(tm).refinement
    assert result is not None and result.runs == len(fxckpt.inspect(tm).plans[0].segments)
    assert result.seconds > 0 and result.predicted > 0
    print(f"GPU refinement: {result}")


def test_offload_auto_on_the_gpu_runs_copies_beside_the_compute_and_is_exact() -> None:
    """On CUDA, offload='auto' plans with copies on a side stream (planning/overlap.py): the
    plan's note says so, what it moves fits in the room it states, and the steps are exact."""
    import re

    model, reference = _pair(lambda: MLP(depth=8, width=1024, p=0.1))
    tm = fxckpt.transform(model, budget=0.5, offload="auto", offload_device="cpu")
    x = torch.randn(512, 1024, device=DEVICE, requires_grad=True)
    for step in range(3):
        assert_steps_equal(run_step(tm, (x,), {}, seed=step),
                           run_step(reference, (x,), {}, seed=step))
    plan = fxckpt.inspect(tm).plan
    notes = [n for n in plan.notes if "copies beside the compute" in n]
    assert len(notes) == 1, plan.notes
    moved, room = map(float, re.search(r"offload ([0-9.]+) MiB, within the ([0-9.]+) MiB",
                                       notes[0]).groups())
    assert moved <= room
    print(f"GPU offload='auto': {notes[0]}; {fxckpt.inspect(tm).offload_stats}")
