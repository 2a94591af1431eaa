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

import re

import pytest

from conformance import run_case
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
