"""A capture's planner: plans for the eager step, or fitted to the compiled one; the lock."""

from __future__ import annotations

import threading

import torch

import fxckpt
from fxckpt.module import dispatcher_of
from fxckpt.serve.entry_planner import EntryPlanner, planning
from models import MLP


def _planner(compiled_step: bool) -> tuple[EntryPlanner, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(16, 32)
    tm = fxckpt.transform(MLP(), budget=0.7, example_inputs=(x,), capture="graph")
    dispatcher = dispatcher_of(tm)
    entry = next(e for entries in dispatcher.entries.values() for e in entries)
    return EntryPlanner(lambda a, k: dispatcher._keyed(tm, a, k)[1], dispatcher.config,
                        dispatcher.offloader, tm, entry.captured, compiled_step), x


def test_a_planner_for_the_compiled_step_fits_its_plans_to_it() -> None:
    eager, x = _planner(False)
    compiled, _ = _planner(True)
    plain, fitted = eager.build((x,), {}).plan, compiled.build((x,), {}).plan
    assert not any("torch.compile" in note for note in plain.notes)
    assert any("as torch.compile runs it" in note for note in fitted.notes)
    assert fitted.budget_bytes == plain.budget_bytes  # the same budget, in bytes
    assert eager.shapes((x,), {}) == compiled.shapes((x,), {})
    assert compiled.limit(compiled.build((x,), {})) == plain.budget_bytes


def test_planning_runs_one_at_a_time_and_uncompiled() -> None:
    inside: list[bool] = []

    def other() -> None:
        with planning():
            inside.append(True)

    compiled: list[int] = []

    def backend(gm: torch.fx.GraphModule, _: object) -> object:
        compiled.append(1)
        return gm.forward

    doubled = torch.compile(lambda t: t * 2, backend=backend)
    with planning():
        assert torch.equal(doubled(torch.ones(2)), torch.full((2,), 2.0))
        assert compiled == []  # run eagerly: torch.compile is off while planning
        thread = threading.Thread(target=other)
        thread.start()
        thread.join(timeout=0.2)
        assert inside == [] and thread.is_alive()  # the lock holds it back
    thread.join()
    assert inside == [True]
