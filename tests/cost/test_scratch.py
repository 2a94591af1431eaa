"""Kernel scratch (fxckpt/cost/scratch.py): the bytes a CPU convolution allocates for itself,
measured against resident memory, and counted by verification so a CNN's budget holds in RSS
terms."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import fxckpt
from benchmarks.models import spec_for
from fxckpt.measure import (
    LiveTensorTracker,
    read_status,
    reset_peak_rss,
    run_in_subprocess,
    step_peak_rss,
    training_step,
)
from fxckpt.cost.annotate import annotate
from fxckpt.capture.captured import capture
from fxckpt.cost.annotate import has_info, info
from fxckpt.cost.bridge import problem_of
from fxckpt.cost.scratch import backward_scratch, call_scratch
from fxckpt.solver import Op

MIB = 2**20
CONV = torch.ops.aten.convolution.default
CONV_BACKWARD = torch.ops.aten.convolution_backward.default

HEAP_SLACK = 128 * 1024
"""Resident memory a call may add that no rule counts: page rounding, and buffers under the
child's 64 KiB mmap threshold (a 36 KiB weight gradient here), which come from the heap and touch
new pages or not depending on what earlier calls freed (the channels-last row measured -32 KiB
alone and +76 KiB after the other rows)."""

# (batch, in channels, out channels, size, kernel, stride, dims, channels_last)
CONFIGS = [
    (16, 32, 32, 32, 3, 1, 2, False),
    (16, 32, 64, 32, 3, 1, 2, False),
    (16, 64, 32, 32, 3, 1, 2, False),
    (16, 32, 64, 32, 3, 2, 2, False),
    (16, 128, 64, 16, 1, 1, 2, False),
    (16, 32, 32, 1024, 3, 1, 1, False),
    (16, 32, 32, 32, 3, 1, 2, True),
]


def _conv_args(n: int, ci: int, co: int, size: int, k: int, s: int, dims: int,
               channels_last: bool) -> tuple:
    x = torch.randn(n, ci, *(size,) * dims)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(co, ci, *(k,) * dims)
    return (x, w, None, [s] * dims, [k // 2] * dims, [1] * dims, False, [0] * dims, 1)


def measure_conv_scratch(configs: list) -> dict:
    """In a child with one ``mmap`` per block: resident memory one convolution (and its
    backward) adds beyond the tensors it returns, against :func:`call_scratch`'s figures."""
    torch.set_num_threads(1)

    def beyond_outputs(fn) -> int:  # type: ignore[no-untyped-def]
        fn()
        gc.collect()
        before = reset_peak_rss()
        out = fn()
        peak = read_status()["VmHWM"] - before
        outs = out if isinstance(out, tuple) else (out,)
        return peak - sum(t.numel() * t.element_size() for t in outs if t is not None)

    rows = []
    for config in configs:
        args = _conv_args(*config)
        y = CONV(*args)
        back = (torch.randn_like(y), *args[:2], [0], *args[3:], [True, True, False])
        rows.append({
            "forward": [beyond_outputs(lambda: CONV(*args)), call_scratch(CONV, args, {})],
            "backward": [beyond_outputs(lambda: CONV_BACKWARD(*back)),
                         call_scratch(CONV_BACKWARD, back, {})],
            "from_forward": backward_scratch(CONV, args, {}),
            "input": args[0].numel() * 4,
        })
    return {"rows": rows}


def test_convolution_scratch_matches_resident_memory_never_under():
    rows = run_in_subprocess(f"{__name__}:measure_conv_scratch", {"configs": CONFIGS})["rows"]
    for config, row in zip(CONFIGS, rows):
        for phase in ("forward", "backward"):
            measured, counted = row[phase]
            # Never under by more than HEAP_SLACK; over by at most a third of one input.
            assert counted >= 0.95 * measured - HEAP_SLACK, (config, phase, row)
            assert counted <= measured + row["input"] // 3 + 64 * 1024, (config, phase, row)
        assert row["from_forward"] == row["backward"][1], (config, row)
    plain = [row for config, row in zip(CONFIGS, rows) if not config[-1]]
    assert all(row["backward"][0] >= row["input"] for row in plain)  # a layer's worth, or more
    assert rows[-1]["forward"][1] == rows[-1]["backward"][1] == 0  # channels-last: none


def test_scratch_is_zero_for_other_ops_and_unreadable_arguments():
    x = torch.randn(4, 8)
    assert call_scratch(torch.ops.aten.mm.default, (x, x.t()), {}) == 0
    assert backward_scratch(torch.ops.aten.relu.default, (x,), {}) == 0
    assert call_scratch(CONV, (x,), {}) == 0  # too few arguments: nothing to size
    meta = _conv_args(16, 32, 32, 32, 3, 1, 2, False)
    meta = (meta[0].to("meta"), meta[1].to("meta"), *meta[2:])
    assert call_scratch(CONV, meta, {}) == 0  # not a CPU kernel


def test_tracker_adds_scratch_to_the_peak_only():
    args = _conv_args(8, 32, 32, 32, 3, 1, 2, False)
    with LiveTensorTracker() as plain:
        y = CONV(*args)
    with LiveTensorTracker(scratch=call_scratch) as counted:
        y = CONV(*args)
    out = y.numel() * 4
    assert plain.peak_bytes == out
    assert counted.peak_bytes == out + call_scratch(CONV, args, {}) > out
    assert counted.current_bytes == out  # scratch is gone once the kernel returns


def _cnn(channels_last: bool = False) -> tuple:
    spec = spec_for("resnet")
    torch.manual_seed(0)
    model, (x,), loss = spec.build({"blocks": 3, "ch": 32, "hw": 32, "batch": 8})
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    return model, (x,), loss


def test_annotate_records_each_convolutions_scratch_and_reserve_covers_it():
    model, inputs, _ = _cnn()
    gm = annotate(capture(copy.deepcopy(model), inputs, {}).gm, list(inputs))
    convs = [n for n in gm.graph.nodes if has_info(n) and "convolution" in info(n).ops]
    assert convs and all(info(n).scratch > 0 for n in convs)
    problem = problem_of(gm)
    largest = max(op.scratch_bytes for op in problem.ops)
    assert largest == max(info(n).scratch for n in convs)
    assert problem.reserve_bytes >= largest > max(op.gradient_bytes for op in problem.ops)

    model, inputs, _ = _cnn(channels_last=True)
    gm = annotate(capture(copy.deepcopy(model), inputs, {}).gm, list(inputs))
    assert all(info(n).scratch == 0 for n in gm.graph.nodes if has_info(n))


def test_op_scratch_bytes_must_be_a_byte_count():
    with pytest.raises(ValueError, match=r"Op 'a': scratch_bytes must be a non-negative int"):
        Op(name="a", out_bytes=4, cost=1.0, scratch_bytes=-1)


def test_verified_peak_counts_scratch_as_the_real_step_holds_it():
    model, inputs, loss = _cnn()
    tm = fxckpt.transform(copy.deepcopy(model), budget=0.7, example_inputs=inputs,
                          loss_fn=lambda out, *a: loss(out))
    plan = fxckpt.inspect(tm).plan
    step = training_step(tm, inputs, loss)
    step()
    with LiveTensorTracker(scratch=call_scratch) as real:
        step()
    with LiveTensorTracker() as tensors:
        step()
    assert abs(plan.verified_peak - real.peak_bytes) <= 8 * 1024
    assert real.peak_bytes - tensors.peak_bytes >= 2 * 8 * 32 * 32 * 32 * 4  # two activations


def cnn_rss(budget: float) -> dict:
    """In a child: resident peak of a training step of the transformed CNN, and its budget."""
    torch.set_num_threads(1)
    model, inputs, loss = _cnn()
    tm = fxckpt.transform(model, budget=budget, example_inputs=inputs,
                          loss_fn=lambda out, *a: loss(out))
    plan = fxckpt.inspect(tm).plan
    rss = step_peak_rss(training_step(tm, inputs, loss), warmup=2, repeats=3)
    return {"rss": rss["peak_bytes"], "budget": plan.budget_bytes, "verified": plan.verified_peak}


@pytest.mark.parametrize("budget", [0.65, 0.8])
def test_a_cnn_budget_holds_in_resident_memory(budget):
    # Counted as tensors alone, this CNN's plans peaked two activations above their budget in
    # RSS (the bench ResNet: 1.14x); the convolution's reorder buffers now count.
    got = run_in_subprocess(f"{__name__}:cnn_rss", {"budget": budget})
    assert got["verified"] <= got["budget"]
    assert got["rss"] <= 1.05 * got["budget"], got
