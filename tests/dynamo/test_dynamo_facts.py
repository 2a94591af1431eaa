"""Same bits under ordinary Python, through Dynamo (``capture="dynamo"``, fxckpt/serve/dynamo).

Every pattern of ``tests/dynamo_patterns.py`` (the classes of Python a frozen graph gets wrong)
and every pattern of the Python-fact harness (``tests/python_patterns.py``,
``tests/torch_nn_patterns.py``) runs through the unmodified model and through
``fxckpt.transform(model, capture="dynamo", ...)`` with every strategy, for several SGD steps
with the loop's change between the first and the second: outputs, input and parameter gradients,
every buffer, the attributes and the Python state the case names must be bit-identical after
every step, and the parameters after every optimizer step. Where the Dynamo path refuses, the
refusal is named (:data:`REFUSED`).
"""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.nn as nn

import fxckpt
from dynamo_habits import HABIT_CASES
from dynamo_patterns import DYNAMO_CASES, PyCase
from fxckpt.errors import CaptureError
from python_patterns import CASES, Case
from test_python_facts import STRATEGIES
from test_python_facts import _options as options_for
from test_python_facts import _train_both as train_both
from torch_nn_patterns import NN_CASES

REFUSED: dict[str, tuple[type, str]] = {
    # Dynamo replays a held random.Random wrongly from the second call (pytorch behaviour)
    "python_random_held": (CaptureError, r"`<root>\.rand`, a random\.Random random generator"),
    # the model itself leaves gradients off: its own backward fails, with or without fxckpt
    "grad_mode_left_off": (RuntimeError, r"does not require grad"),
}
"""Harness cases the Dynamo path refuses, with the refusal."""

UNPLANNED = {
    # a data-dependent branch inside a loop: Dynamo gives up on the frame and runs it eagerly
    "layer_drop_decision",
    # torch.utils.checkpoint.checkpoint_sequential inside the forward: the same
    "checkpoint_sequential_inside",
    # a hook that appends to a list, registered inside a loop: the same
    "tensor_hook_logs_gradient_norms",
}
"""Harness cases Dynamo runs without any graph: exact, unplanned, and said once."""

KNOWN: dict[str, tuple[str, str]] = {
    # torch 2.13's Dynamo formats an unspecialised float wrongly in an f-string after a graph
    # break (Python state only): the float, not its text
    "logging_a_tensor_value": (r"\d+\.\d{7,}", "Dynamo's f-string"),
    # a torch.jit.script function is inlined as Python (by Dynamo and by torch.export alike):
    # from its second call the model's own call runs TorchScript's autodiff, an ulp away
    "scripted_function_called": ("input grads differ", "TorchScript's autodiff"),
}
"""Divergences of the engines themselves (plain torch.compile shows them too), expected to fail
with this message."""


PY_CASES = DYNAMO_CASES + HABIT_CASES


def _options(case: Case, strategy: str) -> dict[str, Any]:
    return options_for(case, strategy, "dynamo")


def _train_both(case: Case, model: nn.Module, tm: nn.Module, reference: nn.Module) -> None:
    per_step = getattr(case, "per_step", None)
    args, kwargs = case.inputs() if per_step is None else ((), {})
    train_both(case, model, tm, reference, args, kwargs, per_step=per_step,
               state=getattr(case, "state", None))


def _run(case: Case, strategy: str) -> None:
    tm = _trained(case, _options(case, strategy))
    if tm is None:
        return
    if case.name in UNPLANNED:
        assert fxckpt.inspect(tm).graphs == [] and "" in fxckpt.inspect(tm)._dispatcher.dynamo.said
    elif strategy != "none":
        assert fxckpt.inspect(tm).plan.capture == "dynamo"


def _trained(case: Case, options: dict[str, Any]) -> Optional[nn.Module]:
    """The case trained through ``transform(model, **options)`` against a model made alike, or
    ``None`` when the Dynamo path refuses it (by the name :data:`REFUSED` gives)."""
    torch.set_grad_enabled(True)
    torch.manual_seed(0)
    model = case.make()
    torch.manual_seed(0)
    reference = case.make()  # made again, not copied: pruned and scripted modules cannot be
    tm = fxckpt.transform(model, **options)
    refused = REFUSED.get(case.name)
    if refused is not None:
        with pytest.raises(refused[0], match=refused[1]):
            _train_both(case, model, tm, reference)
        torch.set_grad_enabled(True)
        return None
    _train_both(case, model, tm, reference)
    return tm


# the slow tier holds all but a slice of these cases: tests/tiers.py
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("case", PY_CASES, ids=[c.name for c in PY_CASES])
def test_python_around_the_tensors_trains_to_the_same_bits(case: PyCase, strategy: str) -> None:
    if case.name in KNOWN:
        with pytest.raises(AssertionError, match=KNOWN[case.name][0]):
            _run(case, strategy)
        return
    _run(case, strategy)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("case", CASES + NN_CASES, ids=[c.name for c in CASES + NN_CASES])
def test_the_python_fact_harness_through_dynamo(case: Case, strategy: str) -> None:
    _run(case, strategy)


@pytest.mark.parametrize("case", CASES + NN_CASES, ids=[c.name for c in CASES + NN_CASES])
def test_a_budget_each_graph_fits_recomputes_nothing(case: Case) -> None:
    """The default path (no ``capture=``) under a budget every graph's unmodified step fits:
    each graph is planned with no segment, after its peak is verified on fake tensors (never the
    user's forward), and trains to the same bits."""
    tm = _trained(case, {"budget": "1TiB"})
    if tm is None:
        return
    for graph in fxckpt.inspect(tm).graphs:
        assert graph.plan.capture == "dynamo" and not graph.plan.segments, graph.plan.summary()
        assert graph.plan.verified_peak is not None and any(
            "fits the budget: nothing is recomputed" in note for note in graph.plan.notes), (
            graph.plan.notes)
