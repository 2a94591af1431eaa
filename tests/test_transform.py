"""Promise 1 and 2: the transformed module is the model, with the same numbers, for every
strategy."""

from __future__ import annotations

import copy

import pytest
import torch

import fxckpt
from models import CASES, Case
from support import assert_steps_equal, run_step


def _strategies(case: Case) -> list[dict]:
    return [{}, {"every": 1}, {"every": 2}, {"depth": case.depth}]


PARAMS = [
    pytest.param(
        case,
        kw,
        id=f"{case.name}-{'-'.join(f'{k}{v}' for k, v in kw.items()) or 'none'}",
        marks=[pytest.mark.slow] if case.name in ("gpt2", "bert") else [],
    )
    for case in CASES
    for kw in _strategies(case)
]


@pytest.mark.parametrize("case,strategy", PARAMS)
def test_training_step_is_bit_identical(case: Case, strategy: dict) -> None:
    model = case.make().train()
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, **strategy)
    args, kwargs = case.inputs()
    for step in range(2):  # the second step runs the cached plan and the updated buffers
        got = run_step(tm, args, kwargs, seed=step)
        want = run_step(reference, args, kwargs, seed=step)
        assert_steps_equal(got, want)
    if strategy:
        assert fxckpt.inspect(tm).plan.segments, (
            f"{strategy} chose no segment:\n{fxckpt.inspect(tm).plan}"
        )
    else:
        assert (
            not fxckpt.inspect(tm).plan.segments
            and "no strategy" in fxckpt.inspect(tm).plan.notes[0]
        )


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_eval_mode_runs_the_model_itself(case: Case) -> None:
    model = case.make().eval()
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, every=1)
    args, kwargs = case.inputs()
    with torch.no_grad():
        got, want = tm(*args, **kwargs), reference(*args, **kwargs)
    got, want = (dict(got), dict(want)) if hasattr(got, "keys") else (got, want)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert fxckpt.inspect(tm).captures == 0 and fxckpt.inspect(tm).plans == []
