"""Same bits or a clear refusal on the default path: every pattern of ``tests/patterns.py``
(every way a frozen graph can diverge from the model) trained through
``fxckpt.transform(model, ...)`` with no ``capture=``, which trains through Dynamo.

``tests/test_fidelity.py`` runs the same patterns on one whole graph (``capture="graph"``), where
four of them are refused (a custom ``autograd.Function`` at the root, numpy's and Python's global
random generators, a helper object's counter); through Dynamo they train to the same bits.
"""

from __future__ import annotations

from typing import Any

import random

import numpy as np
import pytest
import torch

import fxckpt
from patterns import PATTERNS, Pattern
from support import assert_steps_equal, run_step
from test_fidelity import STRATEGIES, _made, _strategy

@pytest.mark.parametrize(
    "pattern,strategy",
    # offload="auto" plans one whole graph, not Dynamo's (docs/guide.md): test_fidelity has it
    [pytest.param(p, s, id=f"{p.name}-{'-'.join(s) or 'none'}")
     for p in PATTERNS for s in STRATEGIES if "offload" not in s],
)
def test_the_default_path_trains_every_pattern_to_the_same_bits(pattern: Pattern,
                                                                 strategy: dict) -> None:
    model, reference = _made(pattern), _made(pattern)
    tm = fxckpt.transform(model, **_strategy(pattern, strategy))
    args, kwargs = pattern.inputs()
    for step in range(2):
        assert_steps_equal(_step(tm, args, kwargs, step), _step(reference, args, kwargs, step))
    assert [m.training for m in model.modules()] == [m.training for m in reference.modules()]
    if hasattr(model, "hook_log"):
        assert model.hook_log.calls == reference.hook_log.calls
    graphs = fxckpt.inspect(tm).graphs
    assert graphs and {g.plan.capture for g in graphs} == {"dynamo"}
    if ("every" in strategy or "depth" in strategy) and pattern.error is None:
        assert any(g.plan.segments for g in graphs), [g.plan.summary() for g in graphs]


def _step(module: torch.nn.Module, args: tuple, kwargs: dict, seed: int) -> Any:
    """One step, with Python's and numpy's generators seeded as well as torch's."""
    random.seed(seed)
    np.random.seed(seed)
    return run_step(module, args, kwargs, seed=seed)
