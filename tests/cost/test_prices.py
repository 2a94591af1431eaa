"""cost/prices.py: what one aten call costs beyond its FLOPs, in FLOP-equivalents."""

from __future__ import annotations

import math

import torch

from fxckpt.cost.prices import (CALL_PRICE, CPU_ATTENTION_FACTOR, CPU_PRICES, DEFAULT_PRICE,
                                GELU_TANH_PRICE, OTHER_DEVICE_PRICE, OTHER_DEVICE_RANDOM_PRICE,
                                EVEN, RANDOM_PRICE, REDUCTIONS, TABLE, PriceTable, call_price,
                                price_terms, traffic)

aten = torch.ops.aten
MiB = 1 << 20
x = torch.empty(256, 1024)  # 1 MiB of float32


def test_a_pointwise_call_costs_its_bytes_written_at_its_price_plus_the_call() -> None:
    out = torch.empty_like(x)
    assert call_price(aten.tanh.default, (x,), {}, out, random=False) == \
        CALL_PRICE + CPU_PRICES["tanh"] * MiB
    assert call_price(aten.mul.Tensor, (x, x), {}, out, random=False) == \
        CALL_PRICE + DEFAULT_PRICE * MiB  # no entry: a copy's price


def test_in_place_calls_are_priced_like_their_out_of_place_op() -> None:
    assert call_price(aten.tanh_.default, (x,), {}, x, random=False) == \
        call_price(aten.tanh.default, (x,), {}, x, random=False)


def test_gelu_with_the_tanh_approximation_has_its_own_price() -> None:
    tanh = call_price(aten.gelu.default, (x,), {"approximate": "tanh"}, x, random=False)
    exact = call_price(aten.gelu.default, (x,), {}, x, random=False)
    assert (tanh, exact) == (CALL_PRICE + GELU_TANH_PRICE * MiB,
                             CALL_PRICE + CPU_PRICES["gelu"] * MiB)


def test_random_calls_and_other_devices() -> None:
    assert call_price(aten.bernoulli_.float, (x, 0.5), {}, x, random=True) == \
        CALL_PRICE + RANDOM_PRICE * MiB
    meta = torch.empty(256, 1024, device="meta")
    assert call_price(aten.tanh.default, (meta,), {}, meta, random=False) == \
        CALL_PRICE + OTHER_DEVICE_PRICE * MiB
    assert call_price(aten.bernoulli_.float, (meta, 0.5), {}, meta, random=True) == \
        CALL_PRICE + OTHER_DEVICE_RANDOM_PRICE * MiB


def test_a_draws_bytes_are_shared_by_how_close_its_probability_is_to_one_half() -> None:
    def terms(func, *args, **kwargs):  # type: ignore[no-untyped-def]
        return price_terms(func, args, kwargs, x, True)

    assert terms(aten.bernoulli_.float, x, 1.0) == (("call", 1.0), ("random", MiB))
    assert terms(aten.bernoulli_.float, x, 0.0) == (("call", 1.0), ("random", MiB))
    assert terms(aten.bernoulli_.float, x, 0.5) == (("call", 1.0), (EVEN, MiB))
    # a dropout of 0.1 keeps with p = 0.9: a fifth of its bytes at the even price
    (_, (k1, a1), (k2, a2)) = terms(aten.bernoulli_.float, x, 0.9)
    assert (k1, k2) == ("random", EVEN) and math.isclose(a1, 0.8 * MiB) and \
        math.isclose(a2, 0.2 * MiB)
    low = terms(aten.bernoulli_.float, x, p=0.1)
    assert [k for k, _ in low] == ["call", "random", EVEN]
    assert math.isclose(low[1][1], a1) and math.isclose(low[2][1], a2)
    (_, (_, drop), (_, even)) = terms(aten.native_dropout.default, x, 0.3, True)
    assert math.isclose(even, 0.6 * MiB) and math.isclose(drop, 0.4 * MiB)
    # no probability: the draw alone (rand, randn, a tensor of probabilities)
    assert terms(aten.rand_like.default, x) == (("call", 1.0), ("random", MiB))
    assert terms(aten.bernoulli_.Tensor, x, x) == (("call", 1.0), ("random", MiB))
    # the table has one price for both keys, so its prices do not move
    for p in (0.5, 0.9, 1.0):
        assert TABLE.work(terms(aten.bernoulli_.float, x, p)) == \
            CALL_PRICE + RANDOM_PRICE * MiB
    even_dearer = PriceTable(call=0.0, per_byte={}, default=1.0, random=1.0, gelu_tanh=1.0,
                             reductions={})
    assert even_dearer.price(EVEN) == even_dearer.price("random") == 1.0


def test_reductions_pay_for_what_they_read() -> None:
    out = torch.empty(256)
    assert call_price(aten.sum.dim_IntList, (x, [1]), {}, out, random=False) == \
        CALL_PRICE + REDUCTIONS["sum"] * MiB


def test_views_are_free_and_flop_ops_pay_the_call_only() -> None:
    assert call_price(aten.view.default, (x, [1024, 256]), {}, x.view(1024, 256),
                      random=False) == 0.0
    assert call_price(aten.detach.default, (x,), {}, x, random=False) == 0.0  # not marked a view
    w = torch.empty(1024, 1024)
    assert call_price(aten.mm.default, (x, w), {}, x, random=False) == CALL_PRICE
    assert call_price(aten.empty_like.default, (x,), {}, x, random=False) == CALL_PRICE


def test_cpu_attention_pays_its_flops_again_by_the_measured_factor() -> None:
    q = k = v = torch.empty(1, 2, 16, 8)
    kernel = aten._scaled_dot_product_flash_attention_for_cpu.default
    flops = 2 * (2 * 1 * 2 * 16 * 16 * 8)
    assert call_price(kernel, (q, k, v), {}, q, random=False) == \
        CALL_PRICE + (CPU_ATTENTION_FACTOR - 1) * flops


def test_traffic_counts_every_tensor_read_and_written() -> None:
    y = torch.empty(10, dtype=torch.float16)
    assert traffic((x, 3), {"other": y}, [x, (y,)]) == 2 * MiB + 2 * 20
