"""Offload: saved tensors go to host memory and come back exactly, once, with their layout."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import fxckpt
from fxckpt.module import dispatcher_of
from fxckpt.measure import LiveTensorTracker
from fxckpt.cost import rates
from fxckpt.runtime.offload import HostPool, Offloader
from models import MLP, ResNet
from support import assert_steps_equal, loss_of, run_step

def cuda(test):  # type: ignore[no-untyped-def]
    """In the CUDA tier (``pytest -m cuda``); skipped without a CUDA device."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(),
                                               reason="needs CUDA")(test))


@pytest.mark.parametrize(
    "make,shape", [(MLP, (8, 32)), (ResNet, (2, 3, 8, 8))], ids=["mlp", "resnet"]
)
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
    assert (
        dispatcher_of(tm).offloader.in_flight == 0 and not dispatcher_of(tm).offloader.pool.in_use
    )


class Layouts(torch.nn.Module):
    """Saves a tensor, its transpose, a slice and an expanded view: one storage."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = x * 2
        return (
            (base * base.t()).sum()
            + (base[1:] * base[1:]).sum()
            + (base[:, :1].expand(6, 6) * self.w).sum()
        )


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
    # Dynamo's own: after an MLP with another dropout rate in this process, the rate would be a
    # graph input (a 0-d float64 tensor a step saves and moves too, beside the activations)
    torch._dynamo.reset()
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
    moved = (
        fxckpt.inspect(tm).offload_stats.bytes_moved - x.numel() * 4
    )  # x is the caller's: not a new allocation
    assert plain_held - offloaded_held == moved > 0


def _offloaded_mlp() -> tuple[torch.nn.Module, torch.nn.Module]:
    model = MLP(depth=4, width=32, p=0.0)
    eager = copy.deepcopy(model)
    tm = fxckpt.transform(model, every=1, offload=True, offload_device="cpu", offload_threshold=0)
    return tm, eager


def test_second_backward_with_retain_graph_equals_eager() -> None:
    tm, eager = _offloaded_mlp()
    x = torch.randn(8, 32)
    grads = []
    for module in (tm, eager):
        loss = loss_of(module(x))
        loss.backward(retain_graph=True)
        first = [p.grad.clone() for p in module.parameters()]
        loss.backward()  # unpacks every handle again: host copies outlive the first backward
        grads.append((first, [p.grad.clone() for p in module.parameters()]))
        del loss
    for got, want in zip(grads[0], grads[1]):
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    stats, offloader = fxckpt.inspect(tm).offload_stats, dispatcher_of(tm).offloader
    assert stats.offloaded > 0 and stats.unpacked == 2 * stats.offloaded
    assert stats.restored == 2 * stats.storages  # once per storage and pass, views sharing it
    assert offloader.in_flight == 0 and not offloader.pool.in_use  # the graph is freed


def test_forwards_without_backward_give_their_host_buffers_back(monkeypatch) -> None:
    tm, _ = _offloaded_mlp()
    offloader = dispatcher_of(tm).offloader
    x = torch.randn(8, 32)
    for _ in range(5):
        out = tm(x)  # training with grad enabled: an evaluation that never calls backward
        assert offloader.in_flight > 0
        del out

    def fails(h: torch.Tensor) -> torch.Tensor:
        raise ValueError("the head fails")

    monkeypatch.setattr(tm.head, "forward", fails)
    with pytest.raises(ValueError, match="the head fails"):
        tm(x)
    assert fxckpt.inspect(tm).offload_stats.offloaded == 4  # the blocks' saved tensors were packed
    monkeypatch.undo()
    gc.collect()
    assert offloader.in_flight == 0 and not offloader.pool.in_use
    assert offloader.pool.in_use_bytes == 0
    held = offloader.pool.allocated_bytes
    loss_of(tm(x)).backward()  # and the buffers given back serve the next step
    assert offloader.pool.allocated_bytes == held


class Raises(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x)).sin()
        if h.shape[0] == 3:
            raise ValueError("mid-forward")
        return h


def test_a_forward_that_raises_midway_gives_its_host_buffers_back() -> None:
    model, offloader = Raises(), Offloader("cpu", threshold=0)
    for batch in (3,) * 30 + (4,):
        try:
            with offloader.hooks(model):
                out = model(torch.randn(batch, 16))
        except ValueError:
            assert offloader.stats.offloaded >= 2  # the raise came after packing
    del out
    gc.collect()
    assert offloader.in_flight == 0 and not offloader.pool.in_use
    # The storage -> host copy index forgets dead entries when it outgrows the live ones; it is
    # checked after one more step because a test run that frees graphs late (another test's
    # thread or tracer holding frames) may leave it up to twice the copies then in flight.
    with offloader.hooks(model):
        _held = model(torch.randn(4, 16))  # its graph holds the copies in flight
    assert offloader.in_flight == 2
    assert len(offloader._live) <= 2 * offloader.in_flight + 17  # 51 if it never forgot


def test_a_storage_written_in_place_after_it_was_saved_gets_a_new_copy() -> None:
    """The same storage saved before and after an in-place write: two versions, two host copies."""
    x = torch.randn(6, requires_grad=True)
    offloader = Offloader("cpu", threshold=0)
    with offloader.hooks(torch.nn.Module()):
        a = x * 2
        y = a.sin()  # saves a at version 0
        a.add_(1)
        z = a.cos()  # saves a at version 1
    assert offloader.stats.storages == 2
    (y.sum() + z.sum()).backward()
    want = 2 * torch.cos(2 * x.detach()) - 2 * torch.sin(2 * x.detach() + 1)
    torch.testing.assert_close(x.grad, want)


def test_offload_device_is_where_host_buffers_live() -> None:
    tm = fxckpt.transform(MLP(depth=2, width=32, p=0.0), every=1, offload=True,
                          offload_device="cpu", offload_threshold=0)
    loss_of(tm(torch.randn(8, 32))).backward()
    pool = dispatcher_of(tm).offloader.pool
    assert pool.device == torch.device("cpu") and pool.free
    assert all(b.device == pool.device for bs in pool.free.values() for b in bs)
    buf, fence = HostPool(pin=False, device="meta").take(64)  # the pool allocates where it is told
    assert buf.device.type == "meta" and buf.numel() == 64 and fence is None


def test_offload_device_must_be_cpu_or_an_existing_cuda_device() -> None:
    must = "offload_device must be 'cpu' or a CUDA device"
    with pytest.raises(fxckpt.ConfigError, match=must + " .*'meta'"):
        Offloader("meta")
    with pytest.raises(fxckpt.ConfigError, match=must):
        Offloader("not a device")
    if not torch.cuda.is_available():
        missing = "offload_device 'cuda' does not exist: this machine has no CUDA device"
        with pytest.raises(fxckpt.ConfigError, match=missing):
            Offloader("cuda")
        no_cuda = "'cuda' does not exist: this machine has no CUDA device"
        with pytest.raises(fxckpt.ConfigError, match=no_cuda):
            fxckpt.transform(MLP(), every=1, offload=True, offload_device="cuda")


def test_rates_are_timed_on_the_device_after_a_discarded_warm_up(monkeypatch) -> None:
    calls = []

    def timed(fn, device):
        fn()
        calls.append(device)
        return [100.0, 3.0, 1.0, 2.0][(len(calls) - 1) % 4]  # a slow first run, then 3 timings

    monkeypatch.setattr(rates, "timed", timed)
    flops, bandwidth = rates.measure_rates("cpu", "cpu")
    assert calls == [torch.device("cpu")] * 8  # matmul and copy: warm-up + 3 each
    assert flops == 2 * 256**3 / 2.0 and bandwidth == (1 << 22) / 2.0  # medians, warm-up discarded


def test_auto_prices_offload_with_rates_of_the_models_device_once(monkeypatch) -> None:
    asked = []

    def measured(device, host):
        asked.append((device, host))
        return 1e9, 1e9

    monkeypatch.setattr(rates, "measure_rates", measured)
    monkeypatch.setattr(rates, "_RATES", {})
    x = torch.randn(16, 64)
    for _ in range(2):
        fxckpt.transform(MLP(depth=6, width=64), budget=0.6, offload="auto", offload_device="cpu",
                         offload_threshold=0, example_inputs=(x,))
    assert asked == [(torch.device("cpu"), torch.device("cpu"))]  # cached per (device, host)
    meta = torch.nn.Linear(2, 2, device="meta")
    assert rates.device_of(meta) == torch.device("meta")
    assert rates.device_of(torch.nn.ReLU()) == torch.device("cpu")


def test_auto_offloads_when_copies_are_free_and_recomputes_when_slow() -> None:
    x = torch.randn(16, 64)
    fast = fxckpt.transform(
        MLP(depth=6, width=64),
        budget=0.6,
        offload="auto",
        offload_device="cpu",
        offload_threshold=0,
        offload_bandwidth=1e18,
        example_inputs=(x,),
    )
    slow = fxckpt.transform(
        MLP(depth=6, width=64),
        budget=0.6,
        offload="auto",
        offload_device="cpu",
        offload_threshold=0,
        offload_bandwidth=1.0,
        example_inputs=(x,),
    )
    assert {s.action for s in fxckpt.inspect(fast).plan.segments if s.recompute_flops} == {
        "offload"
    }
    assert {s.action for s in fxckpt.inspect(slow).plan.segments} == {"recompute"}
    assert "offloaded" in str(fxckpt.inspect(fast).plan)
    reference = copy.deepcopy(fxckpt.inspect(fast).model)
    assert_steps_equal(run_step(fast, (x,), {}), run_step(reference, (x,), {}))
    assert fxckpt.inspect(fast).offload_stats.offloaded > 0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"offload": "sometimes", "offload_device": "cpu"},
            "offload must be True, False or 'auto' (got 'sometimes')",
        ),
        ({"offload": "auto", "offload_device": "cpu"}, "give budget= too (got budget=None)"),
        (
            {"offload": True, "offload_device": "cpu", "offload_threshold": -1},
            "offload_threshold must be a non-negative integer of bytes (got -1)",
        ),
        (
            {"offload": True, "offload_device": "cpu", "offload_bandwidth": 0},
            "offload_bandwidth must be a positive",
        ),
    ],
)
def test_bad_offload_options(kwargs: dict, message: str) -> None:
    with pytest.raises(fxckpt.ConfigError) as e:
        fxckpt.transform(MLP(), every=1, **kwargs)
    assert message in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CUDA-less error")
def test_offload_without_cuda_needs_a_device() -> None:
    with pytest.raises(
        fxckpt.ConfigError, match="no CUDA device: .*offload_device='cpu'|has no CUDA device"
    ):
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
    assert dispatcher_of(tm).offloader.pool.pin and all(
        b.is_pinned() for bs in dispatcher_of(tm).offloader.pool.free.values() for b in bs
    )


@cuda
def test_cuda_race_with_a_delayed_compute_stream() -> None:
    """Copies must wait for the compute stream: a sleeping kernel before each step must not
    matter."""
    plain, tm, x = _cuda_pair()
    for step in range(100):
        torch.cuda._sleep(1_000_000)
        got = run_step(tm, (x,), {}, seed=step)
        want = run_step(plain, (x,), {}, seed=step)
        assert_steps_equal(got, want)
        tm.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)


@cuda
def test_cuda_copy_back_waits_for_kernels_still_using_its_block() -> None:
    """The block a copy back writes may have been freed by queued kernels that still read it."""
    n = 1 << 22
    x = torch.randn(n, device="cuda", requires_grad=True)
    offloader = Offloader("cpu", threshold=0)
    with offloader.hooks(torch.nn.Module()):
        y = (x * 1).sin()  # saves x * 1: n floats go to the host
    want_grad = torch.cos(x.detach())
    for _ in range(3):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # no cached block of that size but the one scratch frees below
        scratch = torch.full((n,), 7.0, device="cuda")
        torch.cuda._sleep(50_000_000)  # keeps the compute stream busy
        total = scratch.sum()  # queued behind the sleep, reads scratch
        del scratch  # its block is free for the next allocation of this size on this stream
        y.sum().backward(retain_graph=True)  # the copy back allocates n * 4 bytes
        assert total.item() == 7.0 * n
    torch.testing.assert_close(x.grad, 3 * want_grad)


def test_the_offload_price_is_a_power_of_two_so_timing_noise_keeps_plans(monkeypatch) -> None:
    prices = []
    for flops in (0.80e9, 0.92e9, 0.70e9):  # one machine's timings, run to run (+-15%)
        monkeypatch.setattr(rates, "_RATES", {})
        monkeypatch.setattr(rates, "measure_rates", lambda device, host, f=flops: (f, 4e8))
        prices.append(rates.offload_cost_per_byte(None))
    assert prices == [4.0, 4.0, 4.0]  # 2 * 0.8e9 / 4e8 = 4.0, 4.6 and 3.5 round to 2**2
