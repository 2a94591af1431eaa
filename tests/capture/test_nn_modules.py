"""capture/nn_modules.py: the training forwards fxckpt traces torch.nn's transformer modules
with, chosen only where torch.nn's own forward would run, and computing what it computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxckpt.capture.nn_modules import TRACED, traced_forward


def _layer() -> nn.TransformerEncoderLayer:
    return nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)


def test_the_traced_forward_is_chosen_in_training_for_torch_nns_own_forward() -> None:
    layer = _layer()
    assert traced_forward(layer) is TRACED[nn.TransformerEncoderLayer]
    assert traced_forward(nn.TransformerDecoderLayer(8, 2)) is nn.TransformerDecoderLayer.forward
    assert traced_forward(layer.eval()) is None
    assert traced_forward(nn.Linear(2, 2)) is None
    assert traced_forward(nn.MultiheadAttention(8, 2)) is None


def test_a_subclass_is_traced_through_only_without_a_forward_of_its_own() -> None:
    class Plain(nn.TransformerEncoderLayer):
        pass

    class Own(nn.TransformerEncoderLayer):
        def forward(self, src, *args, **kwargs):
            return src

    assert traced_forward(Plain(8, 2)) is TRACED[nn.TransformerEncoderLayer]
    assert traced_forward(Own(8, 2)) is None


@pytest.mark.parametrize("causal", [False, True])
def test_the_encoder_forwards_compute_what_torch_nns_compute(causal: bool) -> None:
    encoder = nn.TransformerEncoder(_layer(), num_layers=2, enable_nested_tensor=False)
    src = torch.randn(2, 5, 8)
    mask = nn.Transformer.generate_square_subsequent_mask(5) if causal else None
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    want = encoder(src, mask=mask, src_key_padding_mask=padding)
    got = traced_forward(encoder)(encoder, src, mask=mask, src_key_padding_mask=padding)
    assert torch.allclose(got, want, atol=1e-6)
    layer = encoder.layers[0]
    assert torch.allclose(traced_forward(layer)(layer, src, mask, padding),
                          layer(src, mask, padding), atol=1e-6)


def test_the_transformer_forward_computes_what_torch_nns_computes_and_checks_inputs() -> None:
    model = nn.Transformer(8, 2, num_encoder_layers=1, num_decoder_layers=1,
                           dim_feedforward=16, dropout=0.0, batch_first=True)
    src, tgt = torch.randn(2, 5, 8), torch.randn(2, 3, 8)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(3)
    want = model(src, tgt, tgt_mask=tgt_mask)
    assert torch.allclose(traced_forward(model)(model, src, tgt, tgt_mask=tgt_mask), want,
                          atol=1e-6)
    with pytest.raises(RuntimeError, match="the batch number of src and tgt must be equal"):
        traced_forward(model)(model, src, torch.randn(4, 3, 8))
