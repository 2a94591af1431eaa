"""Device profiles: plans priced for the GPU they will run on (fxckpt/cost/devices.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fxckpt
from fxckpt.cli import main
from fxckpt.cost.annotate import annotate
from fxckpt.capture.captured import capture
from fxckpt.cost.annotate import info
from fxckpt.planning.actions import _within_the_forward
from fxckpt.cost.devices import PROFILES, DeviceProfile, cpu_profile, profile_for
from fxckpt.cost.bridge import problem_of
from fxckpt.solver import Op, Problem
from models import MLP

H100 = PROFILES["h100"]
TOY = DeviceProfile("toy", {"bfloat16": 100.0, "float16": 100.0, "float32": 10.0},
                    memory=50.0, link=5.0, launch=0.5, segment=2.0, keep=1.0)


def test_a_node_costs_its_roofline_time_in_flop_equivalents_at_the_bf16_rate() -> None:
    assert TOY.seconds(flops=1000, moved=100, calls=1, dtype="bfloat16") == 10 + 0.5
    assert TOY.seconds(flops=1000, moved=100, calls=1, dtype="float32") == 100 + 0.5
    assert TOY.seconds(flops=10, moved=1000, calls=2, dtype="bfloat16") == 20 + 1.0  # memory
    assert TOY.cost(flops=1000, moved=0, calls=0, dtype="bfloat16") == 1000  # a bf16 FLOP: 1
    assert TOY.seconds(flops=1000, moved=0, calls=0, dtype="int64") == 100  # fp32's rate


def test_the_problem_is_priced_by_the_profile() -> None:
    x = torch.randn(64, 256)
    gm = annotate(capture(MLP(depth=2, width=256, p=0.0), (x,), {}).gm, [x])
    cpu, gpu = problem_of(gm), problem_of(gm, H100)
    assert gpu.segment_overhead == pytest.approx(H100.segment * H100.unit)
    assert gpu.keep_overhead == pytest.approx(H100.keep * H100.unit)
    nodes = {n.name: n for n in gm.graph.nodes}
    priced = [o for o in gpu.ops if o.name in nodes]
    assert priced
    for op in priced:
        i = info(nodes[op.name])
        assert op.cost == pytest.approx(H100.cost(i.flops, i.moved, len(i.calls), i.dtypes[0]))
    fc = next(o for o in priced if o.name == "layers_0_fc")
    flops = 2 * 64 * 256 * 256  # an fp32 matmul at 52 TFLOP/s, plus a launch per call
    assert fc.cost >= flops / H100.matmul["float32"] * H100.unit
    assert fc.cost != next(o for o in cpu.ops if o.name == "layers_0_fc").cost


def test_profiles_by_name_and_the_models_own_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert profile_for("h100", torch.device("cpu")) is H100
    assert profile_for(None, torch.device("cpu")) is None  # the table: FXCKPT_CPU_PRICES=table
    monkeypatch.setenv("FXCKPT_CPU_PRICES", "measured")
    assert profile_for(None, torch.device("cpu")) is cpu_profile()  # measured once
    assert profile_for("cpu", torch.device("cpu")) is None  # named: the table everywhere
    assert profile_for("cpu", torch.device("meta")) is None
    with pytest.raises(fxckpt.ConfigError, match=r"device_profile must be one of 'h100', "
                                                 r"'h200', 'a100', 'cpu' \(got 'tpu'\)"):
        fxckpt.transform(MLP(), budget=0.5, device_profile="tpu")


def test_copies_that_the_forward_cannot_hide_are_recomputed_instead() -> None:
    ops = (Op(name="a", out_bytes=1000, cost=10.0),
           Op(name="b", out_bytes=10, cost=10.0, inputs=("a",), saves=("a",)),
           Op(name="c", out_bytes=1000, cost=10.0, inputs=("b",)),
           Op(name="d", out_bytes=10, cost=10.0, inputs=("c",), saves=("c",)))
    ranges = [(0, 1), (2, 3)]
    cheap = Problem(ops=ops, outputs=("d",), offload_cost_per_byte=0.02)  # 10 out per 1000 B
    offloads = [True, True]
    assert _within_the_forward(cheap, ranges, offloads) == 0 and offloads == [True, True]
    dear = Problem(ops=ops, outputs=("d",), offload_cost_per_byte=0.06)  # 30 + 30 > 40
    offloads = [True, True]
    assert _within_the_forward(dear, ranges, offloads) == 1 and offloads.count(True) == 1


def test_the_cli_prices_a_meta_plan_for_a_gpu(tmp_path: Path) -> None:
    from test_meta import write_config

    write_config(tmp_path)
    plans = {}
    for profile in ("h100", "cpu"):
        out = tmp_path / f"{profile}.json"
        assert main(["plan", str(tmp_path), "--meta", "--input-shape", "2,32", "--dtype",
                     "int64", "--budget", "0.5", "--device-profile", profile,
                     "--plan-out", str(out)]) == 0
        plans[profile] = json.loads(out.read_text())
    assert plans["h100"]["options"]["device_profile"] == "h100"
    assert plans["cpu"]["options"]["device_profile"] == "cpu"
    assert plans["h100"]["predicted_recompute"] != plans["cpu"]["predicted_recompute"]


def test_a_meta_model_planned_for_a_gpu_may_offload_on_a_machine_without_one() -> None:
    """Planning for a named GPU runs nothing on this machine's devices: ``offload='auto'``
    needs no ``offload_device``; without a profile it still asks for one. (Not verified:
    verification keeps offloaded tensors on the device, so it would count them.)"""
    import fxckpt
    from models import MLP

    with torch.device("meta"):
        model = MLP(depth=6, width=256)
    x = torch.zeros(512, 256, device="meta")
    tm = fxckpt.transform(model, budget=0.5, device_profile="h100", offload="auto",
                          offload_bandwidth=1e15, verify=False, example_inputs=(x,))
    plan = fxckpt.inspect(tm).plan
    assert plan.segments and "offload" in {s.action for s in plan.segments}
    if not torch.cuda.is_available():
        with pytest.raises(fxckpt.ConfigError,
                           match="this machine has no CUDA device; pass offload_device='cpu'"
                                 " .* or device_profile= to plan for a GPU"):
            fxckpt.transform(MLP(), budget=0.5, offload="auto")


def test_copies_overlap_on_a_gpu_or_for_a_gpu_profile_and_not_on_a_cpu() -> None:
    from fxckpt.cost.devices import copies_overlap

    cpu, cuda, meta = (torch.device(d) for d in ("cpu", "cuda", "meta"))
    assert copies_overlap("h100", cpu) and copies_overlap("a100", meta)
    assert copies_overlap(None, cuda)
    assert not copies_overlap("cpu", cuda)       # a CPU's prices: synchronous copies
    assert not copies_overlap(None, cpu) and not copies_overlap(None, meta)
