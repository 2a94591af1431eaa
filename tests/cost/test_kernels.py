"""Matmul, convolution and attention calls keyed by their shapes (fxckpt.cost.kernels)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fxckpt.cost import cpu_table, kernels
from fxckpt.cost.cpu_table import MeasuredTable, _rounded
from fxckpt.cost.prices import CPU_ATTENTION_FACTOR, TABLE

aten = torch.ops.aten


def _calls() -> list[tuple[Any, tuple, dict]]:
    x, w, b = torch.rand(64, 32), torch.rand(48, 32), torch.rand(48)
    q, k, v = (torch.rand(2, 4, 16, 8) for _ in range(3))
    img, kernel = torch.rand(2, 3, 10, 12), torch.rand(5, 3, 3, 3)
    conv = (img, kernel, None, [2, 1], [1, 0], [1, 1], False, [0, 0], 1)
    out = aten.convolution(*conv)
    return [
        (aten.mm.default, (x, w.t()), {}),
        (aten.addmm.default, (b, x, w.t()), {}),
        (aten.bmm.default, (torch.rand(3, 5, 7), torch.rand(3, 4, 7).transpose(1, 2)), {}),
        (aten.baddbmm.default, (torch.rand(3, 5, 4), torch.rand(3, 5, 7), torch.rand(3, 7, 4)),
         {}),
        (aten.convolution.default, conv, {}),
        (aten.convolution_backward.default,
         (torch.rand_like(out), img, kernel, None, [2, 1], [1, 0], [1, 1], False, [0, 0], 1,
          [True, True, False]), {}),
        (aten._scaled_dot_product_flash_attention_for_cpu.default, (q, k, v, 0.0, True), {}),
    ]


@pytest.mark.parametrize("call", _calls(), ids=lambda c: c[0].overloadpacket.__name__)
def test_a_key_counts_torchs_flops_and_makes_the_same_call_again(call: Any) -> None:
    func, args, kwargs = call
    found = kernels.key(func, args, kwargs)
    assert found is not None
    text, flops = found
    counter = FlopCounterMode(display=False)
    with counter:
        expected = func(*args, **kwargs)
    if func is not aten._scaled_dot_product_flash_attention_for_cpu.default:
        assert flops == counter.get_total_flops()  # torch's own formulas
    assert kernels.flops_of(text) == flops
    again = kernels.timed_call(text)()
    shapes = [t.shape for t in (again if isinstance(again, tuple) else (again,))
              if isinstance(t, torch.Tensor)]
    assert shapes == [t.shape for t in (expected if isinstance(expected, tuple) else (expected,))
                      if isinstance(t, torch.Tensor)]


def test_the_key_names_a_transposed_layout() -> None:
    x, w = torch.rand(64, 32), torch.rand(48, 32)
    plain = kernels.key(aten.mm.default, (x, w.t().contiguous()), {})
    transposed = kernels.key(aten.mm.default, (x, w.t()), {})
    assert plain is not None and transposed is not None and plain != transposed
    assert "((32, 48), True)" in transposed[0] and "((32, 48), False)" in plain[0]


def test_other_calls_have_no_key() -> None:
    x = torch.rand(4, 4)
    assert kernels.key(aten.add.Tensor, (x, x), {}) is None
    mask = torch.ones(4, 4, dtype=torch.bool)
    q = torch.rand(1, 1, 4, 4)
    assert kernels.key(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q),
                       {"attn_mask": mask}) is None


def test_the_table_prices_kernels_as_flops_and_attention_by_its_factor() -> None:
    calls = {c[0].overloadpacket.__name__: c for c in _calls()}
    mm = kernels.key(*calls["mm"])
    attention = kernels.key(*calls["_scaled_dot_product_flash_attention_for_cpu"])
    assert mm is not None and attention is not None
    assert TABLE.price(mm[0]) == 0.0
    assert TABLE.price(attention[0]) == CPU_ATTENTION_FACTOR - 1


def test_a_measured_kernel_is_priced_by_its_time_per_flop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    text, flops = kernels.key(*_calls()[0])  # type: ignore[misc]
    seconds = {"t": 3 * flops / 1e11}  # a third of the unit's rate
    monkeypatch.setattr(cpu_table, "_best", lambda fn, repeats=3: seconds["t"])
    table = MeasuredTable(rate=1e11, call=0.0)
    assert table.price(text) == pytest.approx(_rounded(3.0) - 1)  # 2 beyond the FLOPs
    assert table.work([(text, flops)]) == pytest.approx((_rounded(3.0) - 1) * flops)
    seconds["t"] = flops / 1e13  # a hundred times the unit: never less than 0.1 of its FLOPs
    assert MeasuredTable(rate=1e11, call=0.0).price(text) == -0.9
    assert table.scale == 1.0  # kernels are not pointwise prices
