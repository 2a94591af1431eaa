"""torch's global random state under threads (fxckpt/runtime/state.py).

A data-loading thread draws from torch's generator while fxckpt transforms, plans and trains: no
value it draws may repeat. A fork around fake-tensor runs, or a recompute that saves and sets the
generator for a segment that draws nothing, would rewind the thread's stream.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn

import fxckpt
from fxckpt.runtime.segment import SegmentModule
from fxckpt.runtime.state import alone, torch_random_kept, torch_states


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
