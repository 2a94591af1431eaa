"""Offload: saved tensors go to host memory and come back exactly, once, with their layout."""

from __future__ import annotations

import copy

import pytest
import torch

import fxckpt
from fxckpt.module import dispatcher_of
from fxckpt.measure import LiveTensorTracker
from fxckpt.runtime.offload import Offloader
from models import MLP, ResNet
from support import assert_steps_equal, loss_of, run_step

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("make,shape", [(MLP, (8, 32)), (ResNet, (2, 3, 8, 8))], ids=["mlp", "resnet"])
def test_offload_equals_the_plain_checkpointed_run(make, shape) -> None:
    model = make()
    plain = fxckpt.transform(copy.deepcopy(model), every=1)
    tm = fxckpt.transform(model, every=1, offload=True, offload_device="cpu", offload_threshold=0)
    x = torch.randn(*shape, requires_grad=True)
    for step in range(2):
        assert_steps_equal(run_step(tm, (x,), {}, seed=step), run_step(plain, (x,), {}, seed=step))
    stats = fxckpt.inspect(tm).offload_stats
    assert stats.offloaded > 0 and stats.offloaded == stats.unpacked
    assert stats.skipped_state > 0  # weight.t() and friends stayed put
    assert dispatcher_of(tm).offloader.in_flight == 0 and not dispatcher_of(tm).offloader.pool.in_use


class Layouts(torch.nn.Module):
    """Saves a tensor, its transpose, a slice and an expanded view: one storage."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = x * 2
        return (base * base.t()).sum() + (base[1:] * base[1:]).sum() + (base[:, :1].expand(6, 6) * self.w).sum()


def test_views_share_one_host_copy_and_keep_their_layout() -> None:
    model = Layouts()
    x = torch.randn(6, 6, requires_grad=True)
    offloader = Offloader("cpu", threshold=0)
    with offloader.hooks(model):
        out = model(x)
    # base, base.t(), base[1:] (twice) and the expanded column: five handles, one host copy.
    assert offloader.stats.offloaded == 5 and offloader.stats.storages == 1
    assert offloader.stats.bytes_moved == 36 * 4  # the expanded view was not materialised
    out.backward()
    got = (x.grad.clone(), model.w.grad.clone())
    x.grad = model.w.grad = None
    model(x).backward()
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], model.w.grad)
    assert offloader.stats.unpacked == offloader.stats.offloaded and offloader.in_flight == 0


def test_host_memory_is_flat_and_forward_residency_drops() -> None:
    model = MLP(depth=8, width=64, p=0.0)
    x = torch.randn(32, 64)
    plain = fxckpt.transform(copy.deepcopy(model), every=1)
    tm = fxckpt.transform(model, every=1, offload=True, offload_device="cpu", offload_threshold=0)
    pool = dispatcher_of(tm).offloader.pool
    sizes = []
    for _ in range(10):
        loss_of(tm(x)).backward()
        sizes.append(pool.allocated_bytes)
    assert len(set(sizes)) == 1 and not pool.in_use

    def resident_after_forward(module: torch.nn.Module) -> int:
        with LiveTensorTracker() as tracker:
            out = module(x)
            held = tracker.current_bytes
        loss_of(out).backward()
        return held

    plain_held, offloaded_held = resident_after_forward(plain), resident_after_forward(tm)
    moved = fxckpt.inspect(tm).offload_stats.bytes_moved - x.numel() * 4  # x is the caller's: not a new allocation
    assert plain_held - offloaded_held == moved > 0


def test_auto_offloads_when_copies_are_free_and_recomputes_when_slow() -> None:
    x = torch.randn(16, 64)
    fast = fxckpt.transform(MLP(depth=6, width=64), budget=0.6, offload="auto", offload_device="cpu",
                            offload_threshold=0, offload_bandwidth=1e18, example_inputs=(x,))
    slow = fxckpt.transform(MLP(depth=6, width=64), budget=0.6, offload="auto", offload_device="cpu",
                            offload_threshold=0, offload_bandwidth=1.0, example_inputs=(x,))
    assert {s.action for s in fxckpt.inspect(fast).plan.segments if s.recompute_flops} == {"offload"}
    assert {s.action for s in fxckpt.inspect(slow).plan.segments} == {"recompute"}
    assert "offloaded" in str(fxckpt.inspect(fast).plan)
    reference = copy.deepcopy(fxckpt.inspect(fast).model)
    assert_steps_equal(run_step(fast, (x,), {}), run_step(reference, (x,), {}))
    assert fxckpt.inspect(fast).offload_stats.offloaded > 0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"offload": "sometimes", "offload_device": "cpu"}, "offload must be True, False or 'auto' (got 'sometimes')"),
        ({"offload": "auto", "offload_device": "cpu"}, "give budget= too (got budget=None)"),
        ({"offload": True, "offload_device": "cpu", "offload_threshold": -1},
         "offload_threshold must be a non-negative number of bytes (got -1)"),
        ({"offload": True, "offload_device": "cpu", "offload_bandwidth": 0}, "offload_bandwidth must be a positive"),
    ],
)
def test_bad_offload_options(kwargs: dict, message: str) -> None:
    with pytest.raises(fxckpt.ConfigError) as e:
        fxckpt.transform(MLP(), every=1, **kwargs)
    assert message in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CUDA-less error")
def test_offload_without_cuda_needs_a_device() -> None:
    with pytest.raises(fxckpt.ConfigError, match="no CUDA device: .*offload_device='cpu'|has no CUDA device"):
        fxckpt.transform(MLP(), every=1, offload=True)


def _cuda_pair() -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """A checkpointed MLP on CUDA with and without offload, and an input."""
    model = MLP(depth=4, width=256, p=0.0).cuda()
    plain = fxckpt.transform(copy.deepcopy(model), every=1)
    tm = fxckpt.transform(model, every=1, offload=True, offload_threshold=0)
    return plain, tm, torch.randn(64, 256, device="cuda", requires_grad=True)


@cuda
def test_cuda_offload_uses_pinned_pool_and_matches() -> None:
    plain, tm, x = _cuda_pair()
    assert_steps_equal(run_step(tm, (x,), {}), run_step(plain, (x,), {}))
    assert dispatcher_of(tm).offloader.pool.pin and all(b.is_pinned() for bs in dispatcher_of(tm).offloader.pool.free.values() for b in bs)


@cuda
def test_cuda_race_with_a_delayed_compute_stream() -> None:
    """Copies must wait for the compute stream: a sleeping kernel before each step must not matter."""
    plain, tm, x = _cuda_pair()
    for step in range(100):
        torch.cuda._sleep(1_000_000)
        got = run_step(tm, (x,), {}, seed=step)
        want = run_step(plain, (x,), {}, seed=step)
        assert_steps_equal(got, want)
        tm.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
