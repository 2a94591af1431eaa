"""The CPU's prices measured on the machine (fxckpt.cost.cpu_table), and plans priced with them."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import fxckpt
from fxckpt.cost import cpu_table
from fxckpt.cost.bridge import priced_problem, problem_of
from fxckpt.cost.cpu_table import MeasuredTable, _rounded, uses_measured_prices
from fxckpt.cost.devices import cpu_profile, profile_for
from fxckpt.cost.prices import EVEN, TABLE, PriceTable, call_price, price_terms
from fxckpt.module import dispatcher_of

aten = torch.ops.aten
MiB = 1 << 20


class Tanhs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)).sigmoid() * 2


def test_terms_priced_by_the_table_are_the_call_price() -> None:
    x = torch.rand(256, 1024)
    cases = [(aten.tanh.default, (x,), {}, torch.tanh(x), False),
             (aten.gelu.default, (x,), {"approximate": "tanh"}, x, False),
             (aten.sum.dim_IntList, (x, [1]), {}, x.sum(1), False),
             (aten.bernoulli_.float, (x, 0.5), {}, x, True),
             (aten.mm.default, (x, x.T), {}, x @ x.T, False)]
    for func, args, kwargs, out, random in cases:
        terms = price_terms(func, args, kwargs, out, random)
        assert TABLE.work(terms) == call_price(func, args, kwargs, out, random) > 0
    assert price_terms(aten.tanh.default, (x,), {}, x, False) == (("call", 1.0), ("tanh", MiB))
    assert price_terms(aten.sum.dim_IntList, (x, [1]), {}, x.sum(1), False) == \
        (("call", 1.0), ("read:sum", MiB))
    assert price_terms(aten.mm.default, (x, x.T), {}, x, False) == (("call", 1.0),)
    assert price_terms(aten.view.default, (x, [-1]), {}, x.view(-1), False) == ()


def test_a_table_prices_each_key() -> None:
    table = PriceTable(call=10.0, per_byte={"tanh": 3.0}, default=1.0, random=7.0,
                       gelu_tanh=5.0, reductions={"sum": 2.0})
    assert table.work([("call", 2), ("tanh", 4), ("mul", 4), ("random", 1), ("gelu_tanh", 1),
                       ("read:sum", 3)]) == 20 + 12 + 4 + 7 + 5 + 6


def test_measured_prices_are_rounded_to_quarter_powers_of_two() -> None:
    for price in (0.3, 1.0, 5.5, 22.0, 490.0):
        r = _rounded(price)
        assert 4 * math.log2(r) == round(4 * math.log2(r))
        assert abs(math.log2(r) - math.log2(price)) <= 0.125 + 1e-9
    assert _rounded(0.0) == 0.0 and _rounded(-1.0) == 0.0


def test_a_measured_table_measures_each_op_once_and_scales_the_rest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seconds = {"mul": 2e-5, "tanh": 1e-4}
    runs: list[str] = []

    def fake_cold(fn: cpu_table.Call, repeats: int = 3, cold: int = 16) -> float:
        name = next(k for k, f in table._calls.items() if f is fn)
        runs.append(name)
        return seconds[name]

    monkeypatch.setattr(cpu_table, "cold_seconds", fake_cold)
    table = MeasuredTable(rate=1e11, call=1e5)
    mul = table.price("mul")
    assert mul == _rounded((2e-5 * 1e11 - 1e5) / MiB)  # per byte, less the call
    assert table.price("mul") == mul and runs == ["mul"]  # measured once
    assert table.scale == mul / TABLE.price("mul")
    tanh = table.price("tanh")
    assert tanh == _rounded((1e-4 * 1e11 - 1e5) / MiB)
    # an op with no call to time: the table's price at the median ratio measured so far
    ratio = sorted([mul / TABLE.price("mul"), tanh / TABLE.price("tanh")])
    assert table.price("erfinv") == _rounded(TABLE.price("erfinv") * sum(ratio) / 2)
    assert table.price("call") == 1e5
    assert table.price("attention") == TABLE.price("attention")  # relative to matmul FLOPs
    assert runs == ["mul", "tanh"]
    assert table.work([("call", 1), ("mul", 2.0)]) == 1e5 + 2 * mul


def test_a_draw_is_measured_alone_and_at_one_half(monkeypatch: pytest.MonkeyPatch) -> None:
    probabilities: list[float] = []

    def fake_cold(fn: cpu_table.Call, repeats: int = 3, cold: int = 16) -> float:
        x = torch.zeros(4)
        real = torch.Tensor.bernoulli_

        def spy(self: torch.Tensor, p: float = 0.5, **kwargs: object) -> torch.Tensor:
            probabilities.append(p)
            return real(self, p, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(torch.Tensor, "bernoulli_", spy)
        fn(x)
        monkeypatch.setattr(torch.Tensor, "bernoulli_", real)
        return {1.0: 1e-4, 0.5: 3e-4}[probabilities[-1]]

    monkeypatch.setattr(cpu_table, "cold_seconds", fake_cold)
    table = MeasuredTable(rate=1e11, call=1e5)
    alone, even = table.price("random"), table.price(EVEN)
    assert probabilities == [1.0, 0.5]
    assert alone == _rounded((1e-4 * 1e11 - 1e5) / MiB)
    assert even == _rounded((3e-4 * 1e11 - 1e5) / MiB)
    # a dropout of 0.1 (keeps with 0.9): four fifths of its bytes alone, one fifth at one half
    x = torch.empty(256, 1024)
    terms = price_terms(aten.bernoulli_.float, (x, 0.9), {}, x, True)
    assert math.isclose(table.work(terms), 1e5 + MiB * (0.8 * alone + 0.2 * even))


def test_measuring_draws_nothing_from_torchs_generator() -> None:
    state = torch.get_rng_state()
    table = MeasuredTable(rate=1e11, call=0.0)
    assert table.price("random") > 0 and table.price("tanh") > 0
    assert torch.equal(torch.get_rng_state(), state)


def test_every_timed_call_runs_its_op() -> None:
    x = torch.rand(256, 1024) + 0.5
    for key, fn in cpu_table._calls().items():
        recorded: list[str] = []

        class Ops(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore
                recorded.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        with Ops():
            fn(x.clone())
        name = key.removeprefix("read:")
        if key.startswith("random"):
            name = "bernoulli"
        elif key == "gelu_tanh":
            name = "gelu"
        assert any(r.rstrip("_") == name.rstrip("_") or r == name for r in recorded), \
            (key, recorded)


def test_the_environment_chooses_measured_or_table_prices() -> None:
    assert uses_measured_prices({}) is True  # the default
    assert uses_measured_prices({"FXCKPT_CPU_PRICES": "measured"}) is True
    assert uses_measured_prices({"FXCKPT_CPU_PRICES": "table"}) is False
    with pytest.raises(fxckpt.ConfigError,
                       match=r"FXCKPT_CPU_PRICES must be 'measured' or 'table' \(got 'fast'\)"):
        uses_measured_prices({"FXCKPT_CPU_PRICES": "fast"})
    # every rank of a job must make the same plan: the table, not each machine's timings
    assert uses_measured_prices({"WORLD_SIZE": "4"}) is False
    assert uses_measured_prices({"WORLD_SIZE": "1"}) is True


def test_ranks_of_a_process_group_plan_with_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert uses_measured_prices({}) is False
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    assert uses_measured_prices({}) is True


def test_a_cpu_plan_is_priced_by_the_machines_prices(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(32, 64)
    tm = fxckpt.transform(Tanhs(), example_inputs=(x,))
    gm = dispatcher_of(tm).last.gm
    assert priced_problem(gm).ops == problem_of(gm).ops  # the tests' environment: the table
    monkeypatch.setenv("FXCKPT_CPU_PRICES", "measured")
    profile = profile_for(None, torch.device("cpu"))
    assert profile is cpu_profile() and profile.table is not None
    measured = {op.name: op.cost for op in priced_problem(gm).ops}
    table = {op.name: op.cost for op in problem_of(gm).ops}
    assert measured.keys() == table.keys()
    from fxckpt.cost.annotate import info

    for node in gm.graph.nodes:
        if node.name in measured and node.name != "loss::assumed":
            i = info(node)
            assert measured[node.name] == pytest.approx(i.flops + profile.table.work(i.priced))
            assert table[node.name] == pytest.approx(i.flops + i.work)
    tanh = next(n for n in gm.graph.nodes if n.name.startswith("tanh"))
    (key, count), = info(tanh).priced  # the call, to be timed at its own shape
    assert key.startswith("timed:aten.tanh.default") and "(32, 64)" in key and count == 1.0
    assert measured[tanh.name] == profile.table.price(key) > 0
    assert TABLE.work(info(tanh).priced) == info(tanh).work  # the table prices its terms
    # the overheads are the table's seconds, in this machine's unit
    assert priced_problem(gm).segment_overhead == pytest.approx(
        3e7 / cpu_table.TABLE_RATE * profile.unit)
    monkeypatch.setenv("FXCKPT_CPU_PRICES", "table")
    assert priced_problem(gm, "cpu").ops == problem_of(gm).ops


def test_planning_with_measured_prices_changes_no_process_state(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXCKPT_CPU_PRICES", "measured")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5), nn.Tanh(), nn.Linear(64, 64))
    expected = copy.deepcopy(model)
    x = torch.randn(32, 64)
    state, threads = torch.get_rng_state(), torch.get_num_threads()
    tm = fxckpt.transform(model, budget=0.9, example_inputs=(x,))
    assert torch.equal(torch.get_rng_state(), state)  # measuring drew from its own generator
    assert torch.get_num_threads() == threads and torch.is_grad_enabled()
    assert "random" in cpu_table.measured_table().measured  # dropout priced per byte, measured
    torch.manual_seed(7)
    out = tm(x)
    out.sum().backward()
    torch.manual_seed(7)
    ref = expected(x)  # the same dropout mask
    ref.sum().backward()
    assert torch.equal(out, ref)
    assert all(torch.equal(a.grad, b.grad)
               for a, b in zip(model.parameters(), expected.parameters()))
