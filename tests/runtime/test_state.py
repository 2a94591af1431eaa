"""Saved and restored state (fxckpt/runtime/state.py): values come back exactly, and no other
module of fxckpt reads or sets torch's random or autocast state itself.

Under threads: a data-loading thread draws from torch's generator while fxckpt transforms, plans
and trains: no value it draws may repeat. A fork around fake-tensor runs, or a recompute that
saves and sets the generator for a segment that draws nothing, would rewind the thread's stream.
"""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fxckpt
from fxckpt.runtime.segment import SegmentModule
from fxckpt.runtime.state import (
    AutocastState,
    TensorValues,
    alone,
    autocast_kept,
    autocast_state,
    copies,
    generator_states,
    put,
    set_generator_states,
    set_torch_states,
    torch_random_kept,
    torch_states,
    values_kept,
)


def _mlp() -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                           for _ in range(4)])


class _Drawer:
    """A thread drawing float64 numbers from torch's global generator until stopped."""

    def __init__(self) -> None:
        self.draws: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.draws.append(torch.rand((), dtype=torch.float64).item())

    def __enter__(self) -> "_Drawer":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


OPTIONS = {
    "every": dict(every=1),
    "budget": dict(budget=0.7),
    "bytes_that_fit": dict(budget="1GiB"),  # the unmodified step, measured on fake tensors
    "offload_auto": dict(budget=0.7, offload="auto", offload_device="cpu"),
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_a_drawing_thread_never_sees_a_value_twice(option: str) -> None:
    x = torch.randn(16, 32)
    with _Drawer() as drawer:
        for _ in range(3):  # no manual_seed here: that would rewind the thread itself
            model = _mlp()
            tm = fxckpt.transform(model, **OPTIONS[option], capture="graph")
            for _ in range(2):  # the first step plans; the second runs the plan
                tm(x).sum().backward()
    assert len(drawer.draws) > 1000  # the thread really drew throughout
    assert len(set(drawer.draws)) == len(drawer.draws)


@pytest.mark.parametrize("option", ["every", "budget"])
def test_once_dynamo_compiled_a_drawing_thread_never_sees_a_value_twice(option: str) -> None:
    """The default path: Dynamo saves and puts back torch's generator around each compile (plain
    torch.compile does too), so a thread drawing while a graph compiles can see values again;
    once the step's graphs are compiled and planned, training calls fork nothing."""
    x = torch.randn(16, 32)
    tm = fxckpt.transform(_mlp(), **OPTIONS[option])
    for batch in (16, 8, 16):  # a static graph, then the dynamic one Dynamo makes
        tm(x[:batch]).sum().backward()
    with _Drawer() as drawer:
        while len(drawer.draws) < 2000:
            for _ in range(5):
                tm(x).sum().backward()
    assert len(set(drawer.draws)) == len(drawer.draws)
    assert fxckpt.inspect(tm).plan.capture == "dynamo"


def test_a_segment_saves_the_generator_only_when_it_draws() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.Dropout(0.5),
                          nn.Linear(8, 8))
    tm = fxckpt.transform(model, every=1, example_inputs=(torch.randn(4, 8),))
    segments = [m for m in fxckpt.inspect(tm).graph_module.modules()
                if isinstance(m, SegmentModule)]
    draws = {tuple(n.target for n in s.graph.nodes if n.op == "call_module"): s.draws
             for s in segments}
    assert any(d for d in draws.values()) and not all(draws.values()), draws
    for modules, drawn in draws.items():
        assert drawn == ("3" in modules), draws  # the Dropout is child "3"


def test_the_state_is_put_back_only_when_the_thread_was_alone() -> None:
    torch.manual_seed(0)
    before = torch_states()
    with torch_random_kept():
        torch.rand(3)
    # a test session may hold other tests' threads: then nothing is put back
    assert all(torch.equal(a, b) for a, b in zip(before, torch_states())) == alone()
    with _Drawer():
        with torch_random_kept():
            torch.rand(3)
            moved = torch_states()
        after = torch_states()
    assert not torch.equal(moved[0], before[0])
    assert not torch.equal(after[0], before[0])  # left to advance: never rewound


def test_restored_torch_states_draw_the_same_numbers() -> None:
    torch.manual_seed(123)
    torch.rand(5)  # any point of the stream
    saved = torch_states()
    first = (torch.rand(64), torch.randn(64), torch.nn.functional.dropout(torch.ones(64), 0.5))
    set_torch_states(saved)
    again = (torch.rand(64), torch.randn(64), torch.nn.functional.dropout(torch.ones(64), 0.5))
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert torch.equal(torch_states()[0], torch_states()[0])
    assert not torch.equal(torch_states()[0], saved[0])  # the draws advanced it


def test_restored_generator_states_draw_the_same_numbers() -> None:
    generators = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    saved = generator_states(generators)
    first = [torch.rand(16, generator=g) for g in generators]
    set_generator_states(generators, saved)
    again = [torch.rand(16, generator=g) for g in generators]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], first[1])  # each its own state


def test_tensor_values_come_back_exactly_into_the_same_tensors() -> None:
    bn = nn.BatchNorm1d(4)
    bn(torch.randn(8, 4))  # statistics that are not round numbers
    buffers = list(bn.buffers())
    expected = [b.clone() for b in buffers]
    saved = TensorValues(buffers)
    saved.add(buffers)  # a tensor is taken once
    assert len(saved) == 3
    bn(torch.randn(8, 4) * 3 + 1)
    assert not torch.equal(bn.running_mean, expected[0])
    saved.restore()
    assert [b is c for b, c in zip(bn.buffers(), buffers)] == [True] * 3  # written in place
    for b, e in zip(bn.buffers(), expected):
        assert b.dtype == e.dtype and torch.equal(b, e)
    assert int(bn.num_batches_tracked) == 1
    bn(torch.randn(8, 4))
    saved.restore()  # again on each call
    assert int(bn.num_batches_tracked) == 1


def test_values_kept_puts_values_back_when_the_block_raises() -> None:
    t = torch.arange(3.0)
    with pytest.raises(RuntimeError, match="boom"):
        with values_kept([t]):
            t.mul_(10)
            assert t.tolist() == [0.0, 10.0, 20.0]
            raise RuntimeError("boom")
    assert t.tolist() == [0.0, 1.0, 2.0]


def test_copies_and_put_are_the_two_halves() -> None:
    w = torch.randn(3, requires_grad=True)
    before = copies([w])
    assert not before[0].requires_grad and before[0].data_ptr() != w.data_ptr()
    with torch.no_grad():
        w.add_(1)
    put([w], before)
    assert torch.equal(w.detach(), before[0])
    assert w.grad_fn is None  # autograd did not see the write


def test_autocast_state_round_trips() -> None:
    outer = autocast_state()
    assert outer.devices == ((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
                             (torch.is_autocast_enabled("cuda"),
                              torch.get_autocast_dtype("cuda")))
    assert outer.flat() == (*outer.devices[0], *outer.devices[1])
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        inner = autocast_state()
    assert inner.devices[0] == (True, torch.bfloat16) and not inner.cache
    assert autocast_state() == outer
    inner.apply()
    try:
        assert autocast_state() == inner
    finally:
        outer.apply()
    assert autocast_state() == outer
    changed = AutocastState(((True, torch.bfloat16), outer.devices[1]), not outer.cache)
    with pytest.raises(RuntimeError, match="left"):
        with autocast_kept():
            changed.apply()  # as a forward that enters autocast and fails would leave it
            assert autocast_state() == changed
            raise RuntimeError("left")
    assert autocast_state() == outer


PACKAGE = Path(__file__).resolve().parents[2] / "fxckpt"
STATE = "runtime/state.py"

SET_AND_READ_HERE_ONLY = frozenset({
    # torch's global generators
    "get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all", "fork_rng",
    # autocast
    "is_autocast_enabled", "get_autocast_dtype", "set_autocast_enabled", "set_autocast_dtype",
    "is_autocast_cache_enabled", "set_autocast_cache_enabled",
})
"""torch functions only fxckpt/runtime/state.py calls."""

GENERATOR_STATES_ALSO = {
    "capture/generators.py": "the Python and numpy generators a model holds (not torch's): "
                             "compared and put back by capture, which refuses their draws",
    "capture/traceless.py": "numpy's global generator (not torch's), copied for this "
                              "thread's draws and compared to name a forward that draws from it",
}
"""Modules besides fxckpt/runtime/state.py that may call ``.get_state()``/``.set_state()``,
and why; ``generators.set_state(...)`` (fxckpt.capture.generators' function) is allowed."""


def _offenders(names: frozenset[str], allowed: dict[str, str],
               package: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package).as_posix()
        if where == STATE or where in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            name = None
            if isinstance(node, ast.Attribute) and node.attr in names:
                receiver = node.value
                if not (isinstance(receiver, ast.Name) and receiver.id == "generators"):
                    name = node.attr
            elif isinstance(node, ast.alias) and node.name in names:
                name = node.name  # `from torch import get_rng_state`
            if name is not None:
                found.append(f"fxckpt/{where}:{getattr(node, 'lineno', '?')} {name}")
    return found


def test_only_the_state_module_reads_or_sets_torchs_random_and_autocast_state() -> None:
    assert _offenders(SET_AND_READ_HERE_ONLY, {}) == []


def test_generator_states_are_taken_in_the_state_module_or_where_allowed() -> None:
    assert _offenders(frozenset({"get_state", "set_state"}), GENERATOR_STATES_ALSO) == []


def test_the_scan_finds_a_direct_call(tmp_path: Path) -> None:
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "state.py").write_text("torch.get_rng_state()\n")
    (tmp_path / "a.py").write_text(
        "import torch\nwith torch.random.fork_rng():\n    g.set_state(s)\n"
        "generators.set_state(g, s)\n")
    (tmp_path / "b.py").write_text("from torch import set_rng_state\n")
    assert _offenders(SET_AND_READ_HERE_ONLY, {}, tmp_path) == [
        "fxckpt/a.py:2 fork_rng", "fxckpt/b.py:1 set_rng_state"]
    assert _offenders(frozenset({"get_state", "set_state"}), {}, tmp_path) == [
        "fxckpt/a.py:3 set_state"]
