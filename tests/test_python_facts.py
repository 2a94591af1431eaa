"""Same bits under ordinary Python, or a refusal that names the cause (a differential harness).

Every case of ``tests/python_patterns.py`` runs through the unmodified model and through
``fxckpt.transform`` with every strategy (none, ``every``, ``depth``, a budget with and without
selective recompute, offload) and both capture methods (``symbolic_trace``, ``export``), for
three training steps, with the training loop's change applied to both models between the first
and second. Outputs, input and parameter gradients, every buffer and the attributes the forward
sets must be bit-identical after every step, and the parameters after an optimizer step; or the
transform must refuse at the first call with the documented error, leaving the model as it was.

Python's and numpy's global random state are seeded alike for both models (the cases that draw
from them). The same cases through Dynamo, the default path: ``tests/dynamo/test_dynamo_facts.py``.
"""

from __future__ import annotations

import copy
import random
from typing import Any, Callable, Optional

import numpy as np
import pytest
import torch
import torch.nn as nn

import fxckpt
from python_patterns import CASES, Case
from torch_nn_patterns import NN_CASES
from support import assert_steps_equal, run_step

STRATEGIES: dict[str, dict[str, Any]] = {
    "none": {},
    "every1": {"every": 1},
    "every2": {"every": 2},
    "depth": {"depth": None},
    "budget": {"budget": None},
    "budget_whole": {"budget": None, "selective": False},
    "offload": {"every": 1, "offload": True, "offload_device": "cpu", "offload_threshold": 0},
}
CAPTURES = ("symbolic_trace", "export")


def _options(case: Case, strategy: str, capture: str) -> dict[str, Any]:
    options = dict(STRATEGIES[strategy], capture=capture)
    if "depth" in options:
        options["depth"] = case.depth
    if "budget" in options:
        options["budget"] = case.budget
    return options


def _attribute(model: nn.Module, path: str) -> Any:
    owner, _, name = path.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, name)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a.detach(), b.detach())
    return bool(a == b)


def _state(model: nn.Module) -> tuple:
    return (tuple(m.training for m in model.modules()),
            {k: v.clone() for k, v in model.state_dict().items()})


# the slow tier holds all but a slice of these cases: tests/tiers.py
@pytest.mark.parametrize("capture", CAPTURES)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("case", CASES + NN_CASES, ids=[c.name for c in CASES + NN_CASES])
def test_same_bits_or_a_named_refusal(case: Case, strategy: str, capture: str) -> None:
    torch.manual_seed(0)
    model = case.make()
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, **_options(case, strategy, capture))
    args, kwargs = case.inputs()
    error = case.error or (case.export_error if capture == "export" else case.symbolic_error)
    if error is not None:
        before = _state(model)
        with pytest.raises(error[0], match=error[1]):
            tm(*args, **kwargs)
        after = _state(model)
        assert before[0] == after[0]
        assert all(torch.equal(before[1][k], after[1][k]) for k in before[1])
        return
    _train_both(case, model, tm, reference, args, kwargs)
    assert [m.training for m in model.modules()] == [m.training for m in reference.modules()]
    assert fxckpt.inspect(tm).plan.capture == capture


def _train_both(case: Case, model: nn.Module, tm: nn.Module, reference: nn.Module, args: tuple,
                kwargs: dict, per_step: Optional[Callable[[int], tuple[tuple, dict]]] = None,
                state: Optional[Callable[[nn.Module], Any]] = None) -> None:
    """``case.steps`` SGD steps of ``tm`` (transformed ``model``) and ``reference``, the case's
    change applied to both between the first and second; every step bit-identical. Python's and
    numpy's global generators are seeded alike before each (the cases that draw from them).
    ``per_step``: each step's inputs instead of ``args``/``kwargs``; ``state``: Python state
    the forward touches, compared after each step."""
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-4) for m in (tm, reference)]
    for step in range(case.steps):
        if step == 1 and case.between is not None:
            case.between(model)
            case.between(reference)
        if per_step is not None:
            torch.manual_seed(100 + step)
            args, kwargs = per_step(step)
        call_kwargs = dict(kwargs, **(case.call_kwargs[step] if case.call_kwargs else {}))
        steps = []
        for module in (tm, reference):
            random.seed(step)
            np.random.seed(step)
            steps.append(run_step(module, args, call_kwargs, seed=step))
        assert_steps_equal(*steps)
        for path in case.attributes:
            assert _same(_attribute(model, path), _attribute(reference, path)), path
        if state is not None:
            assert state(model) == state(reference), (step, state(model), state(reference))
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p, q), f"parameter {name} after step {step}"
