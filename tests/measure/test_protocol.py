"""Tests for fxckpt/measure/protocol.py: both memory measures against hand-computed bytes and
each other."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import pytest
import torch
import torch.utils.checkpoint

import fxckpt
from fxckpt.measure import (
    LiveTensorTracker,
    MeasureError,
    error_text,
    run_in_subprocess,
    step_memory,
    step_peak_rss,
    step_peak_tracked,
    time_by_turns,
    time_step,
    training_step,
)

N, W = 256, 128
BLOCK = N * W * 4  # bytes of one float32 [N, W] activation


def _mlp(layers: int, width: int = W) -> torch.nn.Sequential:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*mods)


def test_tracker_matmul_chain_peak_is_exact() -> None:
    n = 128
    square = n * n * 4
    x = torch.randn(n, n)
    with LiveTensorTracker() as t:
        a = x @ x
        b = a @ a            # a, b alive: 2 squares
        del a
        c = b @ b            # b, c alive: 2 squares
        d = c.t()            # a view allocates nothing
        c.add_(1.0)          # neither does an in-place op
        assert t.current_bytes == 2 * square
        del b, c, d
    assert t.peak_bytes == 2 * square
    assert t.current_bytes == 0
    assert t.allocated_bytes == 3 * square
    assert t.peak_bytes_by_device == {"cpu": 2 * square}


def test_tracker_ignores_storages_that_existed_before() -> None:
    x = torch.randn(64, 64)
    model = torch.nn.Linear(64, 64)
    with LiveTensorTracker() as t:
        x.view(-1)
        x.mul_(2.0)
        model.weight.t()
        model.weight.detach()
    assert t.peak_bytes == 0 and t.allocated_bytes == 0


def test_tracker_sees_backward_exactly() -> None:
    n = 128
    square = n * n * 4
    x = torch.randn(n, n, requires_grad=True)
    w = torch.randn(n, n)
    with LiveTensorTracker() as t:
        loss = (x @ w).relu().sum()
        # mm output and relu output were alive together; relu's output stays saved for backward.
        assert (t.peak_bytes, t.current_bytes) == (2 * square, square + 4)
        t.reset_peak()
        loss.backward()
    # backward peak: saved relu output + its gradient + the scalar loss and its seed gradient
    assert t.peak_bytes == 2 * square + 8
    assert t.current_bytes == square + 4  # x.grad and loss
    assert x.grad is not None


def test_tracker_sees_checkpoint_recompute_in_backward() -> None:
    layers = 5
    mlp = _mlp(layers)
    x = torch.randn(N, W, requires_grad=True)

    def checkpointed(inp: torch.Tensor) -> torch.Tensor:
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # recompute whole segments
            for i in range(0, 2 * layers, 2):
                inp = torch.utils.checkpoint.checkpoint(mlp[i : i + 2], inp, use_reentrant=False)
        return inp

    allocated = {}
    for name, fn in (("eager", mlp), ("checkpoint", checkpointed)):
        fn(x).sum().backward()  # gradients exist from here on: backward only accumulates
        out = fn(x)
        with LiveTensorTracker() as t:
            out.sum().backward()
        allocated[name] = t.allocated_bytes
    # recompute runs each Linear and GELU once more in backward: two activations per layer
    assert allocated["checkpoint"] - allocated["eager"] == 2 * layers * BLOCK


def test_tracker_shows_fxckpt_every_1_saves_memory() -> None:
    layers = 6
    mlp = _mlp(layers)
    x = torch.randn(N, W, requires_grad=True)
    tm = fxckpt.transform(mlp, every=1, example_inputs=(x,))
    peaks, held = {}, {}
    for name, m in (("eager", mlp), ("fxckpt", tm)):
        m(x).sum().backward()
        with LiveTensorTracker() as t:
            out = m(x)
            held[name] = t.current_bytes
            out.sum().backward()
            del out
        peaks[name] = t.peak_bytes
    assert held["eager"] == 2 * layers * BLOCK  # every Linear and GELU output kept
    assert held["fxckpt"] == layers * BLOCK     # only segment inputs and the output kept
    assert peaks["fxckpt"] < 0.7 * peaks["eager"]


def test_step_peak_tracked_reports_median() -> None:
    x = torch.randn(N, W)
    result = step_peak_tracked(lambda: (x * 2) * 3, warmup=1, repeats=3)
    assert result == {"peak_bytes": 2 * BLOCK, "samples": [2 * BLOCK] * 3}


def test_rss_protocol_measures_a_64_mib_tensor() -> None:
    result = run_in_subprocess("fxckpt.measure:calibrate_rss", {"mib": 64})
    assert result["expected_bytes"] == 64 * 2**20
    assert abs(result["peak_bytes"] - 64 * 2**20) < 0.1 * 64 * 2**20, result
    assert len(result["samples"]) == 3


def mlp_step_peaks(layers: int, batch: int, width: int) -> dict[str, Any]:
    """Subprocess target: RSS and tracker peaks of one training step of a deep MLP."""
    torch.set_num_threads(1)
    mlp = _mlp(layers, width)
    x = torch.randn(batch, width, requires_grad=True)

    def step() -> None:
        # Not .sum(): backward from its stride-0 gradient allocates scratch inside a kernel, which
        # RSS sees and the tracker cannot (about 6% more RSS at width 256, nothing at width 1024).
        mlp(x).pow(2).mean().backward()

    rss = step_peak_rss(step, warmup=1, repeats=3)
    tracked = step_peak_tracked(step, warmup=0, repeats=1)
    return {"rss": rss["peak_bytes"], "tracked": tracked["peak_bytes"],
            "env": os.environ.get("MALLOC_MMAP_THRESHOLD_")}


def test_rss_and_tracker_agree_on_an_mlp_step() -> None:
    result = run_in_subprocess(
        f"{__name__}:mlp_step_peaks", {"layers": 6, "batch": 1024, "width": 256}
    )
    assert result["env"] == "65536"
    assert result["tracked"] > 13 * 2**20  # 13 activations of 1 MiB at least (with pow's input)
    assert abs(result["rss"] - result["tracked"]) < 0.05 * result["tracked"], result


def child_env() -> dict[str, Any]:
    """Subprocess target: the allocator setting the child was started with."""
    return {"env": os.environ.get("MALLOC_MMAP_THRESHOLD_")}


def test_run_in_subprocess_can_use_the_default_allocator() -> None:
    assert run_in_subprocess(f"{__name__}:child_env", {}, mmap_threshold=None) == {"env": None}


def not_a_dict() -> list[int]:
    """Subprocess target that breaks the contract."""
    return [1, 2]


def test_run_in_subprocess_reports_failures() -> None:
    with pytest.raises(ValueError, match="package.module:function"):
        run_in_subprocess("no_colon", {})
    with pytest.raises(MeasureError, match="(?s)exit code 1.*no_such_function"):
        run_in_subprocess("fxckpt.measure:no_such_function", {})
    with pytest.raises(MeasureError, match="must return a JSON-able dict"):
        run_in_subprocess(f"{__name__}:not_a_dict", {})


def test_time_step_is_the_median() -> None:
    delays = iter([0.0, 0.03, 0.001, 0.002])  # warm-up, then three timed calls

    def fn() -> None:
        time.sleep(next(delays))

    assert 0.001 <= time_step(fn, repeats=3, warmup=1) < 0.02
    with pytest.raises(ValueError, match="repeats must be a positive integer"):
        time_step(fn, repeats=0)


def test_time_by_turns_warms_up_then_times_each_step_once_per_round() -> None:
    calls: list[str] = []
    samples = time_by_turns({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                            repeats=2)
    # one warm-up round, then two rounds taken by turns: a settling call, then the timed one
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 2
    assert {k: len(v) for k, v in samples.items()} == {"a": 2, "b": 2}
    assert all(s >= 0 for v in samples.values() for s in v)
    calls.clear()
    time_by_turns({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                  repeats=2, settle=0)
    assert calls == ["a", "b"] * 3
    with pytest.raises(fxckpt.ConfigError, match=r"^repeats must be .* integer \(got 0\)$"):
        time_by_turns({"a": lambda: None}, repeats=0)
    for bad in (-1, 1.0, True):
        with pytest.raises(fxckpt.ConfigError,
                           match=r"^settle must be a non-negative integer \(got "):
            time_by_turns({"a": lambda: None}, settle=bad)  # type: ignore[arg-type]


def test_time_by_turns_times_a_step_after_one_of_its_own() -> None:
    """The timed call of each turn follows a call of the same step, not of the step before it:
    the state a step leaves (here a flag; in a real run the allocator's pages) is its own."""
    last: list[str] = []
    seen: list[tuple[str, str]] = []

    def step(name: str) -> Callable[[], None]:
        def run() -> None:
            seen.append((name, last[-1] if last else ""))
            last.append(name)
        return run

    time_by_turns({"a": step("a"), "b": step("b")}, repeats=3)
    timed = seen[2:][1::2]  # after the warm-up round, every second call is the timed one
    assert timed == [("a", "a"), ("b", "b")] * 3


def test_training_step_runs_forward_loss_and_backward() -> None:
    model, x = torch.nn.Linear(3, 1), torch.randn(4, 3)
    training_step(model, (x,), lambda y: y.sum())()
    assert model.bias.grad is not None and model.bias.grad.item() == pytest.approx(4.0)


def test_step_memory_reports_a_failing_tracker_instead_of_raising() -> None:
    calls = {"n": 0}

    def step() -> None:  # RSS warm-up and one RSS step pass, the tracked step fails
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")

    result = step_memory(step, repeats=1)
    assert set(result) == {"rss_bytes", "rss_samples", "tracked_bytes", "tracked_error"}
    assert result["tracked_bytes"] is None and result["tracked_error"] == "RuntimeError: boom"
    assert len(result["rss_samples"]) == 1
    assert set(step_memory(lambda: None, repeats=1, tracked=False)) == {"rss_bytes", "rss_samples"}
    assert error_text(ValueError("x" * 700), limit=20) == "ValueError: xxxxx..."
