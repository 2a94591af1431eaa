"""cost/rates.py: the machine rates that price offloading against recomputation."""

from __future__ import annotations

import math

import pytest
import torch

from fxckpt.cost import rates
from fxckpt.cost.devices import PROFILES
from fxckpt.cost.devices import offload_price
from fxckpt.cost.rates import device_of, measure_rates, offload_cost_per_byte

PROFILES_H100_UNIT = PROFILES["h100"].unit  # type: ignore[union-attr]


def test_rates_are_plausible_for_any_cpu() -> None:
    flops, bandwidth = measure_rates("cpu", "cpu")
    assert 1e8 < flops < 1e14  # a 256^3 matmul: between 0.1 GFLOP/s and 100 TFLOP/s
    assert 1e7 < bandwidth < 1e13  # a 4 MiB copy: between 10 MB/s and 10 TB/s


def test_the_price_is_out_and_back_at_the_matmul_rate_rounded_to_a_power_of_two(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rates, "_RATES", {(torch.device("cpu"), torch.device("cpu")):
                                          (100e9, 5e9)})
    # 2 * 100e9 / 5e9 = 40 FLOP-equivalents per byte, rounded to the nearest power of two
    assert offload_cost_per_byte(None) == 32.0
    assert offload_cost_per_byte(2e9) == 2.0 ** round(math.log2(100.0)) == 128.0


def test_rates_are_measured_once_per_device_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[torch.device, torch.device]] = []

    def measure(device: torch.device, host: torch.device) -> tuple[float, float]:
        calls.append((device, host))
        return 1e9, 1e9

    monkeypatch.setattr(rates, "_RATES", {})
    monkeypatch.setattr(rates, "measure_rates", measure)
    assert offload_cost_per_byte(None) == offload_cost_per_byte(None) == 2.0
    assert calls == [(torch.device("cpu"), torch.device("cpu"))]


def test_a_model_computes_where_its_first_tensor_lives() -> None:
    assert device_of(torch.nn.Linear(2, 2)) == torch.device("cpu")
    assert device_of(torch.nn.Linear(2, 2, device="meta")) == torch.device("meta")
    assert device_of(torch.nn.ReLU()) == torch.device("cpu")  # nothing to look at
    bn = torch.nn.BatchNorm1d(2, affine=False, device="meta")  # buffers only
    assert device_of(bn) == torch.device("meta")


def test_with_a_device_profile_the_price_is_its_rate_over_the_link_and_nothing_is_timed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from fxckpt.cost.devices import PROFILES

    def refuse(*_: object) -> tuple[float, float]:
        raise AssertionError("timed")

    monkeypatch.setattr(rates, "measure_rates", refuse)
    monkeypatch.setattr(rates, "_RATES", {})
    h100 = PROFILES["h100"]
    assert h100 is not None
    assert offload_price(h100, None, "meta") == 2 * h100.unit / h100.link
    assert offload_price(h100, 25e9, "meta") == 2 * h100.unit / 25e9  # the bandwidth asked for


def test_a_meta_model_without_a_profile_is_priced_with_the_cpus_rates(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[torch.device] = []

    def measure(device: torch.device, host: torch.device) -> tuple[float, float]:
        seen.append(device)
        return 1e9, 1e9

    monkeypatch.setattr(rates, "_RATES", {})
    monkeypatch.setattr(rates, "measure_rates", measure)
    assert offload_price(None, None, "meta") == 2.0
    assert seen == [torch.device("cpu")]


def test_offload_auto_plans_a_meta_model_for_a_gpu_at_the_bandwidth_asked_for() -> None:
    """Nothing is timed on the meta device (a matmul there fails: "Cannot copy out of meta
    tensor"): the bandwidth asked for is the rate. A GPU's copies run beside its compute, so
    the rate sets how many bytes move while the forward runs: twice the rate, twice the bytes.
    """
    import re

    import fxckpt

    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(*(m for _ in range(6) for m in (
            torch.nn.Linear(256, 256), torch.nn.GELU())))
    x = torch.empty(2048, 256, device="meta")
    rooms = []
    for bandwidth in (2e11, 4e11):
        tm = fxckpt.transform(model, budget=0.7, offload="auto", offload_device="cpu",
                              offload_bandwidth=bandwidth, device_profile="h100",
                              example_inputs=(x,))
        plan = fxckpt.inspect(tm).plan
        assert plan.segments and plan.peak_bytes <= 0.7 * plan.eager_peak_bytes
        found = [re.search(r"within the ([0-9.]+) MiB the host link moves while the forward", n)
                 for n in plan.notes]
        rooms += [float(m.group(1)) for m in found if m]
    assert len(rooms) == 2 and rooms[0] > 1, rooms
    assert rooms[1] == pytest.approx(2 * rooms[0], abs=0.1), rooms