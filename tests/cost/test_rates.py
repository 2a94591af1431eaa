"""cost/rates.py: the machine rates that price offloading against recomputation."""

from __future__ import annotations

import math

import pytest
import torch

from fxckpt.cost import rates
from fxckpt.cost.rates import device_of, measure_rates, offload_cost_per_byte


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
