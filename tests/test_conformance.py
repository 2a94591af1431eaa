"""Conformance: every architecture of ``tests/zoo.py`` trains to the same bits under every
strategy.

For each case (built from a Hugging Face config with random weights, in train mode with dropout
and stochastic depth on) and each strategy (``every=2``, ``depth`` at its blocks, ``budget=0.6``):
outputs, every parameter's gradient and every buffer are ``torch.equal`` to the unmodified model's
over two training steps, and every segment ran twice in a step (recompute observed). What no
capture can replay is refused with the documented error. ``scripts/models_matrix.py`` writes the
same results to ``docs/models.md``.
"""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch

import fxckpt
from conformance import _differences, run_case
from support import run_step
from zoo import HAZARDS, ZOO, ZooCase

EXPECTED_ERRORS = {
    "wav2vec2_specaugment": r"CaptureError: fxckpt cannot capture Wav2Vec2Model exactly: "
    r".*np\.random\.rand\(\) in _compute_mask_indices",
    "wav2vec2_ctc_labels": r"CaptureError: fxckpt could not capture Wav2Vec2ForCTC as a "
    r"torch.fx graph",
    "sew_d": r"CaptureError: fxckpt must call these modules of SEWDModel as they are, but "
    r"torch.export could not swap them back",
}
"""Refusals, with the reason in docs/models.md: numpy randomness in forward, a data-dependent
Python branch on labels, and custom Functions in modules torch.export cannot swap back."""


# the slow tier holds all but a slice of these cases: tests/tiers.py
@pytest.mark.parametrize("case", ZOO + HAZARDS, ids=[c.name for c in ZOO + HAZARDS])
def test_same_bits_with_every_strategy_or_the_documented_refusal(case: ZooCase) -> None:
    result = run_case(case)
    expected = EXPECTED_ERRORS.get(case.name)
    if expected is not None:
        assert result.error is not None
        assert re.match(expected, result.error), result.error
        return
    assert result.error is None, result.error
    assert len(result.outcomes) == 3
    for outcome in result.outcomes:
        assert outcome.segments > 0, f"{outcome.strategy}: no segment"
        assert outcome.exact, f"{outcome.strategy}: {outcome.differs[:5]}"
        assert outcome.recomputed, f"{outcome.strategy}: a segment did not run twice"


# slow tier (tests/slow_tests.txt): 48 models, about a minute
@pytest.mark.parametrize("case", ZOO + HAZARDS, ids=[c.name for c in ZOO + HAZARDS])
def test_under_a_budget_the_step_fits_every_model_trains_with_no_segment(case: ZooCase) -> None:
    """Two training steps on the default path under a budget in bytes every graph's unmodified
    step fits: each graph's peak, verified by running the graph (never the model's forward) on
    fake tensors, fits, so no graph has a segment; bit-identical to a model never
    transformed."""
    model, reference = case.make(), case.make()
    torch.manual_seed(1)
    args, kwargs = case.inputs()
    tm = fxckpt.transform(model, budget="1TiB")
    for step in range(2):
        random.seed(step)
        np.random.seed(step)
        got = run_step(tm, args, kwargs, seed=step)
        random.seed(step)
        np.random.seed(step)
        want = run_step(reference, args, kwargs, seed=step)
        assert not _differences(got, want), f"step {step}: {_differences(got, want)[:5]}"
    for graph in fxckpt.inspect(tm).graphs:
        assert graph.plan.capture == "dynamo" and not graph.plan.segments, graph


def test_the_zoo_covers_what_the_issue_asks() -> None:
    families = {c.family for c in ZOO}
    assert len(ZOO) >= 30
    assert {
        "vision-cnn",
        "vision-transformer",
        "decoder-lm",
        "moe-lm",
        "encoder",
        "encoder-decoder",
        "speech",
        "vision-language",
        "lora",
    } <= families
