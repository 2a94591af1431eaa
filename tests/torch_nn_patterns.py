"""torch.nn's own transformer modules, in the forms users write them.

Cases for the differential harness of ``tests/test_python_facts.py``: ``nn.TransformerEncoder``,
``nn.TransformerDecoder``, ``nn.Transformer`` and their layers, with both ``norm_first``
settings, ``batch_first`` either way, float and boolean attention masks, key-padding masks,
causal masks given as a flag or left to be detected, and ``nn.MultiheadAttention`` inside a
user's block. Dropout is on everywhere, so recompute must replay it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from fxckpt.errors import CaptureError
from python_patterns import Case

D, HEADS, FF, T, B = 32, 4, 64, 10, 4

# torch.export cannot decide at capture whether a mask equals the causal one (it compares
# values); fxckpt's symbolic_trace capture decides it at every call, as the module does.
_DETECTS_CAUSAL = (CaptureError, r"data-dependent")


def _layer(norm_first: bool = False, batch_first: bool = True,
           activation: str = "relu") -> nn.TransformerEncoderLayer:
    return nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.1, batch_first=batch_first,
                                      norm_first=norm_first, activation=activation)


class Encoder(nn.Module):
    """Embedding-free encoder with a head: the common ``nn.TransformerEncoder`` wrapper."""

    def __init__(self, norm_first: bool = False, batch_first: bool = True,
                 activation: str = "relu", final_norm: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(16, D)
        self.enc = nn.TransformerEncoder(
            _layer(norm_first, batch_first, activation), 3,
            norm=nn.LayerNorm(D) if final_norm else None, enable_nested_tensor=False)
        self.head = nn.Linear(D, 8)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None,
                padding: Optional[torch.Tensor] = None,
                causal: Optional[bool] = None) -> torch.Tensor:
        h = self.enc(self.inp(x), mask=mask, src_key_padding_mask=padding, is_causal=causal)
        return self.head(h)


class Decoder(nn.Module):
    """A decoder over an encoded memory, with a causal target mask."""

    def __init__(self, norm_first: bool = False) -> None:
        super().__init__()
        layer = nn.TransformerDecoderLayer(D, HEADS, FF, dropout=0.1, batch_first=True,
                                           norm_first=norm_first)
        self.dec = nn.TransformerDecoder(layer, 3, norm=nn.LayerNorm(D))
        self.head = nn.Linear(D, 8)

    def forward(self, tgt: torch.Tensor, memory: torch.Tensor, tgt_mask: torch.Tensor,
                memory_padding: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.head(self.dec(tgt, memory, tgt_mask=tgt_mask,
                                  memory_key_padding_mask=memory_padding))


class Seq2Seq(nn.Module):
    """``nn.Transformer`` as its documentation uses it."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Transformer(D, HEADS, 2, 2, FF, dropout=0.1, batch_first=True)
        self.head = nn.Linear(D, 8)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor,
                tgt_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.model(src, tgt, tgt_mask=tgt_mask))


class LayerStack(nn.Module):
    """Layers kept in a ModuleList and called by the user's own loop."""

    def __init__(self, decoder: bool = False) -> None:
        super().__init__()
        make: Callable[[], nn.Module] = (
            (lambda: nn.TransformerDecoderLayer(D, HEADS, FF, dropout=0.1, batch_first=True))
            if decoder else _layer)
        self.decoder = decoder
        self.layers = nn.ModuleList(make() for _ in range(3))

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.decoder:
                x = layer(x, x.detach(), tgt_key_padding_mask=padding)
            else:
                x = layer(x, src_key_padding_mask=padding)
        return x.sum(-1)


class AttentionBlocks(nn.Module):
    """A user's pre-norm blocks around ``nn.MultiheadAttention`` (which stays one op)."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(3))
        self.attn = nn.ModuleList(nn.MultiheadAttention(D, HEADS, dropout=0.1, batch_first=True)
                                  for _ in range(3))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(D, FF), nn.GELU(), nn.Linear(FF, D))
                                 for _ in range(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights = []
        for norm, attn, mlp in zip(self.norms, self.attn, self.mlp):
            h = norm(x)
            a, w = attn(h, h, h)  # need_weights=True: the averaged weights come back too
            weights.append(w)
            x = x + a
            x = x + mlp(x)
        return x, torch.stack(weights)


def _causal() -> torch.Tensor:
    return nn.Transformer.generate_square_subsequent_mask(T)


def _padding(n: int = B) -> torch.Tensor:
    padding = torch.zeros(n, T, dtype=torch.bool)
    padding[1, -3:] = True
    padding[3, -5:] = True
    return padding


def _inputs(**kwargs: Any) -> Callable[[], tuple[tuple, dict]]:
    def make() -> tuple[tuple, dict]:
        x = torch.randn(B, T, 16, requires_grad=True)
        return (x,), {k: v() if callable(v) else v for k, v in kwargs.items()}
    return make


def _seq_first() -> tuple[tuple, dict]:
    return (torch.randn(T, B, 16, requires_grad=True),), {"mask": _causal(), "causal": True}


def _decoder_inputs() -> tuple[tuple, dict]:
    tgt = torch.randn(B, T, D, requires_grad=True)
    memory = torch.randn(B, T + 2, D, requires_grad=True)
    padding = torch.zeros(B, T + 2, dtype=torch.bool)
    padding[2, -4:] = True
    return (tgt, memory, _causal()), {"memory_padding": padding}


def _seq2seq_inputs() -> tuple[tuple, dict]:
    return (torch.randn(B, T + 3, D, requires_grad=True),
            torch.randn(B, T, D, requires_grad=True), _causal()), {}


def _stack_inputs() -> tuple[tuple, dict]:
    return (torch.randn(B, T, D, requires_grad=True), _padding()), {}


def _stack_inputs_no_mask() -> tuple[tuple, dict]:
    return (torch.randn(B, T, D, requires_grad=True),), {}


def _bool_mask() -> torch.Tensor:
    mask = torch.rand(T, T) > 0.7
    mask.fill_diagonal_(False)
    return mask


def _flip_norm_first(model: nn.Module) -> None:
    for layer in model.enc.layers:
        layer.norm_first = not layer.norm_first


NN_CASES = [
    Case("nn_encoder", Encoder, _inputs(), depth=3, budget=0.5),
    Case("nn_encoder_norm_first_gelu_final_norm",
         lambda: Encoder(norm_first=True, activation="gelu", final_norm=True),
         _inputs(), depth=3, budget=0.5),
    Case("nn_encoder_causal_mask_detected", Encoder, _inputs(mask=_causal), depth=3,
         export_error=_DETECTS_CAUSAL),
    Case("nn_encoder_causal_flag", Encoder, _inputs(mask=_causal, causal=True), depth=3),
    Case("nn_encoder_padding_mask", Encoder, _inputs(padding=_padding), depth=3),
    Case("nn_encoder_bool_mask_and_padding", Encoder,
         _inputs(mask=_bool_mask, padding=_padding), depth=3, export_error=_DETECTS_CAUSAL),
    Case("nn_encoder_sequence_first", lambda: Encoder(batch_first=False), _seq_first, depth=3),
    Case("nn_encoder_norm_first_flipped", Encoder, _inputs(), depth=3, between=_flip_norm_first),
    Case("nn_decoder", Decoder, _decoder_inputs, depth=3, export_error=_DETECTS_CAUSAL),
    Case("nn_decoder_norm_first", lambda: Decoder(norm_first=True), _decoder_inputs, depth=3,
         export_error=_DETECTS_CAUSAL),
    Case("nn_transformer", Seq2Seq, _seq2seq_inputs, depth=4, export_error=_DETECTS_CAUSAL),
    Case("nn_encoder_layers_in_a_loop", LayerStack, _stack_inputs),
    Case("nn_decoder_layers_in_a_loop", lambda: LayerStack(decoder=True), _stack_inputs),
    Case("nn_multihead_attention_in_user_blocks", AttentionBlocks, _stack_inputs_no_mask),
]
