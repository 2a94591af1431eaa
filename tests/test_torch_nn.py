"""torch.nn's transformer modules are traced through: each layer is a candidate.

Exactness over every strategy and both captures is in ``tests/test_python_facts.py`` (the cases
of ``tests/torch_nn_patterns.py``); here: what the plans find and save, and what they say when a
module the capture keeps whole hides what a strategy asked for.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxckpt
from torch_nn_patterns import B, D, HEADS, T, AttentionBlocks, Decoder, Encoder, Seq2Seq


def _plan(model: nn.Module, args: tuple, kwargs: dict | None = None, **options: object):
    tm = fxckpt.transform(model, capture="symbolic_trace", **options)
    out = tm(*args, **(kwargs or {}))
    (out[0] if isinstance(out, tuple) else out).square().mean().backward()
    return fxckpt.inspect(tm).plan


def _x() -> torch.Tensor:
    return torch.randn(B, T, 16)


@pytest.mark.parametrize("norm_first", [False, True])
def test_depth_checkpoints_each_encoder_layer(norm_first: bool) -> None:
    plan = _plan(Encoder(norm_first=norm_first), (_x(),), {"padding": None}, depth=3)
    assert [s.module_paths for s in plan.segments] == [
        (f"enc.layers.{i}",) for i in range(3)]
    assert plan.predicted_peak < 0.6 * plan.eager_peak


def test_decoder_and_full_transformer_layers_are_segments() -> None:
    mask = nn.Transformer.generate_square_subsequent_mask(T)
    plan = _plan(Decoder(), (torch.randn(B, T, D), torch.randn(B, T + 2, D), mask), depth=3)
    assert [s.module_paths for s in plan.segments] == [(f"dec.layers.{i}",) for i in range(3)]
    plan = _plan(Seq2Seq(), (torch.randn(B, T + 3, D), torch.randn(B, T, D), mask), depth=4)
    assert [p for s in plan.segments for p in s.module_paths] == [
        "model.encoder.layers.0", "model.encoder.layers.1",
        "model.decoder.layers.0", "model.decoder.layers.1"]


def test_a_budget_of_half_holds_on_the_verified_peak() -> None:
    torch.manual_seed(0)
    plan = _plan(Encoder(), (torch.randn(16, 4 * T, 16),), budget=0.5)
    assert plan.segments
    assert plan.verified_peak is not None
    assert plan.verified_peak <= plan.budget_bytes
    assert plan.budget_bytes <= 0.5 * plan.eager_peak_bytes + 1


def test_the_causal_mask_is_detected_at_each_call_as_the_module_does() -> None:
    """The graph asks ``fxckpt_causal_hint`` every call: a causal mask one call and another mask
    the next are both exact (the harness checks bits; here, that the decision is in the code)."""
    tm = fxckpt.transform(Encoder(), capture="symbolic_trace", depth=3)
    tm(_x(), mask=nn.Transformer.generate_square_subsequent_mask(T)).sum().backward()
    code = fxckpt.inspect(tm).code
    assert "causal_hint" in code and "canonical_mask" in code


def test_depth_hidden_by_a_module_kept_whole_names_it() -> None:
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.ModuleList(nn.MultiheadAttention(D, HEADS, batch_first=True)
                                      for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for a in self.attn:
                x = x + a(x, x, x, need_weights=False)[0]
            return x

    plan = _plan(Attention(), (torch.randn(B, T, D, requires_grad=True),), depth=3)
    assert not plan.segments
    note = " ".join(plan.notes)
    assert "no module at depth 3" in note
    assert "attn.0 (MultiheadAttention)" in note and "attn.2 (MultiheadAttention)" in note

    plan = _plan(Attention(), (torch.randn(B, T, D, requires_grad=True),), every=1,
                 force={"attn.1.out_proj": "recompute"})
    note = " ".join(plan.notes)
    assert "it is inside attn.1 (MultiheadAttention)" in note
    assert "force 'attn.1' instead" in note
    assert "is it called in forward" not in note


def test_multihead_attention_in_user_blocks_is_recomputed_whole() -> None:
    plan = _plan(AttentionBlocks(), (torch.randn(B, T, D, requires_grad=True),), depth=2)
    recomputed = {p for s in plan.segments for p in s.module_paths}
    assert {"attn.0", "attn.1", "attn.2"} <= recomputed


def test_eval_mode_capture_keeps_the_encoder_whole() -> None:
    """Outside training the modules take their fast paths, so they stay one op (and say so)."""
    from fxckpt.capture.nn_modules import traced_forward

    encoder = Encoder().enc
    assert traced_forward(encoder) is not None
    encoder.eval()
    assert traced_forward(encoder) is None

    class Custom(nn.TransformerEncoderLayer):
        def forward(self, src: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            return src

    assert traced_forward(Custom(D, HEADS)) is None
