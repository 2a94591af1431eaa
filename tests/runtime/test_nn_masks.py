"""runtime/nn_masks.py: torch.nn's transformer mask handling as single graph calls, each the
code torch's modules run (a boolean mask made additive, the causal test, the input checks)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxckpt.runtime.nn_masks import canonical_mask, causal_hint, check_transformer_inputs


def test_a_boolean_mask_becomes_an_additive_float_mask_of_the_inputs_dtype() -> None:
    mask = torch.tensor([[False, True], [False, False]])
    out = canonical_mask(mask, "src_mask", None, "src_key_padding_mask", torch.ones(1))
    assert out.dtype == torch.float32
    assert out[0, 0] == 0 and out[0, 1] == float("-inf") and not out[1].any()


def test_a_float_mask_passes_through_and_mismatched_types_are_torchs_error() -> None:
    mask = torch.zeros(2, 2)
    assert canonical_mask(mask, "m", None, "o", torch.ones(1)) is mask
    with pytest.raises(AssertionError, match="only bool and floating types of m are supported"):
        canonical_mask(torch.zeros(2, 2, dtype=torch.long), "m", None, "o", torch.ones(1))


def test_the_causal_mask_of_the_sequence_length_is_causal() -> None:
    src = torch.zeros(2, 3, 4)  # batch_first: sequence length 3
    causal = torch.nn.Transformer.generate_square_subsequent_mask(3)
    assert causal_hint(causal, src, batch_first=True)
    assert not causal_hint(torch.zeros(3, 3), src, batch_first=True)
    assert not causal_hint(causal, src, batch_first=False)  # length 2 there


def test_masks_without_values_are_never_causal() -> None:
    causal = torch.nn.Transformer.generate_square_subsequent_mask(3)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(causal)
    assert not causal_hint(fake, torch.zeros(2, 3, 4), batch_first=True)
    assert not causal_hint(causal.to("meta"), torch.zeros(2, 3, 4), batch_first=True)


@pytest.mark.parametrize("src, tgt, batch_first, message", [
    ((2, 3, 4), (5, 3, 4), True, "the batch number of src and tgt must be equal"),
    ((3, 2, 4), (3, 5, 4), False, "the batch number of src and tgt must be equal"),
    ((2, 3, 4), (2, 3, 6), True, "the feature number of src and tgt must be equal to d_model"),
])
def test_transformer_inputs_are_checked_with_torchs_messages(src, tgt, batch_first,
                                                             message) -> None:
    with pytest.raises(RuntimeError, match=f"^{message}$"):
        check_transformer_inputs(torch.zeros(src), torch.zeros(tgt), batch_first, 4)


def test_matching_inputs_pass_the_checks() -> None:
    assert check_transformer_inputs(torch.zeros(2, 3, 4), torch.zeros(2, 5, 4), True, 4) is None
    assert check_transformer_inputs(torch.zeros(3, 4), torch.zeros(5, 4), False, 4) is None
