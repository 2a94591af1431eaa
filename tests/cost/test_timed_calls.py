"""CPU calls keyed by their layout and made again to be timed (fxckpt.cost.timed_calls)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fxckpt.cost import cpu_table, timed_calls
from fxckpt.cost.cpu_table import MeasuredTable, _rounded
from fxckpt.cost.prices import price_terms

aten = torch.ops.aten


def _key(func: Any, args: tuple, kwargs: dict = {}) -> str:
    out = func(*args, **kwargs)
    text = timed_calls.key(func, args, kwargs, out,
                           price_terms(func, args, kwargs, out, random=False))
    assert text is not None
    return text


def test_the_key_names_the_op_shapes_strides_dtype_and_other_arguments() -> None:
    x, w = torch.rand(64, 32), torch.rand(48, 32)
    plain = _key(aten.mm.default, (x, w.t().contiguous()))
    transposed = _key(aten.mm.default, (x, w.t()))
    assert plain.startswith("timed:aten.mm.default") and plain != transposed
    assert "T((32, 48), (1, 32), torch.float32, False)" in transposed
    assert "T((32, 48), (48, 1), torch.float32, False)" in plain
    assert _key(aten.add.Tensor, (x, 1.5)) != _key(aten.add.Tensor, (x, 2.5))
    assert _key(aten.sum.dim_IntList, (x, [1])) != _key(aten.sum.dim_IntList, (x, [0]))
    assert _key(aten.mm.default, (x, w.t())) == transposed  # the same call, the same key


@pytest.mark.parametrize("call", [
    (aten.mm.default, (torch.rand(8, 4), torch.rand(5, 4).t())),
    (aten.mul.Tensor, (torch.rand(2, 3, 4).transpose(0, 1), torch.rand(4))),
    (aten.gelu.default, (torch.rand(3, 7),), {"approximate": "tanh"}),
    (aten.embedding.default, (torch.rand(10, 4), torch.tensor([[1, 2], [3, 9]]))),
    (aten.convolution.default, (torch.rand(2, 3, 9, 9), torch.rand(4, 3, 3, 3), None, [2, 2],
                                [1, 1], [1, 1], False, [0, 0], 1)),
    (aten.native_layer_norm.default, (torch.rand(4, 6), [6], torch.rand(6), None, 1e-5)),
], ids=lambda c: str(c[0]))
def test_a_call_is_made_again_on_inputs_of_its_layout(call: Any) -> None:
    func, args, *rest = call
    kwargs = rest[0] if rest else {}
    text = _key(func, args, kwargs)
    expected = func(*args, **kwargs)
    again = timed_calls._call(text)()
    shapes = [t.shape for t in (again if isinstance(again, tuple) else (again,))]
    assert shapes == [t.shape for t in (expected if isinstance(expected, tuple) else (expected,))]
    assert timed_calls.timed(text, repeats=1) > 0


def test_timing_keeps_the_generator_and_grad_mode_and_hides_from_modes() -> None:
    x = torch.rand(64, 64)
    assert timed_calls.key(aten.bernoulli.p, (x, 0.5), {}, x, ()) is None  # draws: per byte
    text = _key(aten.tanh.default, (x,))
    state = torch.get_rng_state()
    counter = FlopCounterMode(display=False)
    mm = _key(aten.mm.default, (x, x))
    with counter:  # a user's FLOP counter around the step that plans
        timed_calls.timed(text, repeats=1)
        timed_calls.timed(mm, repeats=1)
    assert counter.get_total_flops() == 0
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.is_grad_enabled()


def test_calls_that_cannot_be_made_again_have_no_key() -> None:
    x = torch.rand(4, 4)
    assert timed_calls.key(aten.add.Tensor, (x.to("meta"), 1.0), {}, None, ()) is None
    assert timed_calls.key(aten.add.Tensor, (x, object()), {}, None, ()) is None


def test_the_flops_of_a_call_are_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w = torch.rand(64, 32), torch.rand(48, 32)
    text = _key(aten.mm.default, (x, w.t()))
    assert timed_calls.flops_of(text) == 2 * 64 * 32 * 48
    assert timed_calls.flops_of(_key(aten.relu.default, (x,))) == 0


def test_a_timed_call_is_priced_by_its_time_less_its_flops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    x, w = torch.rand(64, 32), torch.rand(48, 32)
    text = _key(aten.mm.default, (x, w.t()))
    monkeypatch.setattr(timed_calls, "timed", lambda key, repeats=3: 1e-5)
    table = MeasuredTable(rate=1e11, call=0.0)
    assert table.price(text) == _rounded(1e-5 * 1e11) - 2 * 64 * 32 * 48
    assert table.work([(text, 2.0)]) == 2 * table.price(text)


def test_a_call_that_fails_when_made_again_is_priced_by_its_terms(
        monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.rand(256, 1024)
    text = _key(aten.tanh.default, (x,))

    def fails(key: str, repeats: int = 3) -> float:
        raise IndexError("index out of range")

    monkeypatch.setattr(timed_calls, "timed", fails)
    monkeypatch.setattr(cpu_table, "cold_seconds", lambda fn, repeats=3, cold=16: 1e-4)
    table = MeasuredTable(rate=1e11, call=1e5)
    assert table.price(text) == table.work(timed_calls.terms_of(text)) == \
        1e5 + table.price("tanh") * (1 << 20)
    assert table.price("timed:made in another process") == 0.0


def test_a_call_autograd_recorded_is_timed_recording_it() -> None:
    x = torch.rand(8, 8, requires_grad=True).clone()  # an activation
    text = _key(aten.mul.Tensor, (x, 2.0))
    assert "torch.float32, True)" in text
    assert timed_calls._call(text)().grad_fn is not None  # made again as recorded
    assert timed_calls._call(_key(aten.mul.Tensor, (x.detach(), 2.0)))().grad_fn is None
    with torch.no_grad():  # as in a backward pass: nothing recorded
        assert "torch.float32, False)" in _key(aten.mul.Tensor, (x, 2.0))


def test_annotate_keys_a_models_calls_with_their_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    import fxckpt
    from fxckpt.cost.annotate import info
    from fxckpt.module import dispatcher_of

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    tm = fxckpt.transform(model, example_inputs=(torch.rand(4, 8),))
    gm = dispatcher_of(tm).last.gm
    tanh = next(n for n in gm.graph.nodes if "tanh" in n.name or n.target == "1")
    (key, _), = info(tanh).priced
    assert key.startswith("timed:aten.tanh.default") and "True)" in key  # the Linear's output


def test_timing_stops_at_the_time_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.rand(256, 1024)
    first, second = _key(aten.tanh.default, (x,)), _key(aten.sigmoid.default, (x,))
    monkeypatch.setattr(cpu_table, "TIME_LIMIT", 0.0)
    monkeypatch.setattr(cpu_table, "cold_seconds", lambda fn, repeats=3, cold=16: 1e-4)
    table = MeasuredTable(rate=1e11, call=1e5)
    timed_price = table.price(first)  # timed: the limit is only checked before a timing
    assert table.spent > 0 and first in table.measured
    assert table.price(second) == table.work(timed_calls.terms_of(second))  # per byte now
    assert second not in table.measured and timed_price > 0


def test_a_slow_call_is_timed_once_after_its_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.rand(64, 64)
    text = _key(aten.tanh.default, (x,))
    calls: list[int] = []
    func, spec, terms, flops = timed_calls._CALLS[text]

    def slow(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        import time
        time.sleep(0.06 / 32)
        return func(*args, **kwargs)

    monkeypatch.setitem(timed_calls._CALLS, text, (slow, spec, terms, flops))
    monkeypatch.setattr(timed_calls, "_COLD_BYTES", 64 * 64 * 4 * 32)  # 32 copies
    timed_calls.timed(text, repeats=3)
    assert len(calls) == 2 * 32  # the warm-up pass and one timed pass


def test_a_process_keeps_at_most_max_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.rand(4, 4)
    kept = _key(aten.tanh.default, (x,))
    monkeypatch.setattr(timed_calls, "MAX_CALLS", len(timed_calls._CALLS))
    assert timed_calls.key(aten.tanh.default, (x,), {}, x, ()) == kept  # known: still keyed
    assert timed_calls.key(aten.tanh.default, (torch.rand(4, 5),), {}, x, ()) is None  # new


class _Output:
    """A call's output, named by its pass and its place in the pass."""

    def __init__(self, made: tuple[int, int]) -> None:
        self.made = made


def test_outputs_live_through_the_next_pass_and_passes_that_fault_do_not_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import weakref

    clock, faults, passes = [0.0], [0], [0]
    alive: list[weakref.ref] = []
    seen: list[tuple[int, list[tuple[int, int]]]] = []

    def call(place: int) -> _Output:
        if place == 0:  # a pass starts: which earlier outputs are still alive
            seen.append((passes[0], sorted(r().made for r in alive if r() is not None)))
        out = _Output((passes[0], place))
        alive.append(weakref.ref(out))
        # the first five passes fault (a fresh heap) and are slow; later ones 1 s a call,
        # but the seventh 0.5 s
        faults[0] += passes[0] < 5
        clock[0] += 3.0 if passes[0] < 5 else (0.5 if passes[0] == 6 else 1.0)
        if place == 1:
            passes[0] += 1
        return out

    monkeypatch.setattr(timed_calls.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(timed_calls, "_page_faults", lambda: faults[0])
    monkeypatch.setattr(timed_calls, "_SLOW", 1e9)
    best = timed_calls.fastest_pass([lambda: call(0), lambda: call(1)], repeats=3)
    # each pass finds the pass before it alive, and nothing older
    for n, held in seen[1:]:
        assert held == [(n - 1, 0), (n - 1, 1)]
    # 1 warm-up pass, then passes 1-4 faulted and were made up for, then three clean ones
    assert [n for n, _ in seen] == list(range(8))
    assert best == 0.5
    # never more than _SETTLE passes made up for: a machine that always faults is timed anyway
    clock[0], faults[0], passes[0] = 0.0, 0, -100  # every pass faults and is slow
    seen.clear()
    assert timed_calls.fastest_pass([lambda: call(0), lambda: call(1)], repeats=3) == 3.0
    assert len(seen) == 1 + 3 + timed_calls._SETTLE
