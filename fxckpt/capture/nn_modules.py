"""torch.nn's transformer modules, traced through instead of kept as one opaque op.

``torch.fx`` keeps every module of ``torch.nn`` as a leaf: one node, never looked into. For
``nn.Linear`` that is right; for ``nn.TransformerEncoder`` it hides every layer, so no strategy
can checkpoint a layer and a budget finds nothing to recompute. :func:`traced_forward` gives the
tracer, for these modules in training mode, a forward that ``symbolic_trace`` can follow and
that computes what the module's own training forward computes:

* ``TransformerEncoder``, ``TransformerDecoder``, ``Transformer`` and ``TransformerEncoderLayer``
  check and convert masks with Python that branches on tensors; here those steps are single graph
  calls (:mod:`fxckpt.runtime.nn_masks`) that run torch's own code each call. Their fast paths
  (nested tensors, fused kernels) run only outside training, and fxckpt's captures are of
  training calls, so the forward here is their general path.
* ``TransformerDecoderLayer``'s forward traces as it is.
* ``MultiheadAttention`` stays one op: its forward branches on the input's rank. A plan saves or
  recomputes it whole. (``torch.export`` traces into it.)

Subclasses that define their own ``forward`` are traced as written (or kept whole, if torch.nn's).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from fxckpt.runtime.nn_masks import canonical_mask, causal_hint, check_transformer_inputs

__all__ = ["traced_forward", "TRACED"]


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or a graph call to it when an argument is a traced value."""
    proxy = next((a for a in args if isinstance(a, torch.fx.Proxy)), None)
    if proxy is None:
        return fn(*args)
    return proxy.tracer.create_proxy("call_function", fn, args, {})


def _masks(src: Any, mask: Any, padding: Any, names: tuple[str, str]) -> tuple[Any, Any]:
    """The key-padding mask and the attention mask canonicalised as torch.nn's modules do."""
    if padding is not None:
        padding = _call(canonical_mask, padding, names[1], mask, names[0], src)
    if mask is not None:
        mask = _call(canonical_mask, mask, names[0], None, "", src, False)
    return padding, mask


def _causal(mask: Any, is_causal: Optional[bool], src: Any, batch_first: bool) -> Any:
    """``is_causal`` as the containers pass it to their layers (detected when ``None``)."""
    if is_causal is not None or mask is None:
        return is_causal is True
    return _call(causal_hint, mask, src, batch_first)


def _encoder_layer(self: nn.TransformerEncoderLayer, src: Any, src_mask: Any = None,
                   src_key_padding_mask: Any = None, is_causal: bool = False) -> Any:
    src_key_padding_mask, src_mask = _masks(
        src, src_mask, src_key_padding_mask, ("src_mask", "src_key_padding_mask"))
    x = src
    if self.norm_first:
        x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
        x = x + self._ff_block(self.norm2(x))
    else:
        x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask,
                                          is_causal=is_causal))
        x = self.norm2(x + self._ff_block(x))
    return x


def _encoder(self: nn.TransformerEncoder, src: Any, mask: Any = None,
             src_key_padding_mask: Any = None, is_causal: Optional[bool] = None) -> Any:
    src_key_padding_mask, mask = _masks(src, mask, src_key_padding_mask,
                                        ("mask", "src_key_padding_mask"))
    batch_first = self.layers[0].self_attn.batch_first
    causal = _causal(mask, is_causal, src, batch_first)
    output = src
    for mod in self.layers:
        output = mod(output, src_mask=mask, is_causal=causal,
                     src_key_padding_mask=src_key_padding_mask)
    if self.norm is not None:
        output = self.norm(output)
    return output


def _decoder(self: nn.TransformerDecoder, tgt: Any, memory: Any, tgt_mask: Any = None,
             memory_mask: Any = None, tgt_key_padding_mask: Any = None,
             memory_key_padding_mask: Any = None, tgt_is_causal: Optional[bool] = None,
             memory_is_causal: bool = False) -> Any:
    output = tgt
    causal = _causal(tgt_mask, tgt_is_causal, tgt, self.layers[0].self_attn.batch_first)
    for mod in self.layers:
        output = mod(output, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                     tgt_key_padding_mask=tgt_key_padding_mask,
                     memory_key_padding_mask=memory_key_padding_mask,
                     tgt_is_causal=causal, memory_is_causal=memory_is_causal)
    if self.norm is not None:
        output = self.norm(output)
    return output


def _transformer(self: nn.Transformer, src: Any, tgt: Any, src_mask: Any = None,
                 tgt_mask: Any = None, memory_mask: Any = None, src_key_padding_mask: Any = None,
                 tgt_key_padding_mask: Any = None, memory_key_padding_mask: Any = None,
                 src_is_causal: Optional[bool] = None, tgt_is_causal: Optional[bool] = None,
                 memory_is_causal: bool = False) -> Any:
    _call(check_transformer_inputs, src, tgt, self.batch_first, self.d_model)
    memory = self.encoder(src, mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                          is_causal=src_is_causal)
    return self.decoder(tgt, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                        tgt_key_padding_mask=tgt_key_padding_mask,
                        memory_key_padding_mask=memory_key_padding_mask,
                        tgt_is_causal=tgt_is_causal, memory_is_causal=memory_is_causal)


TRACED: dict[type, Callable[..., Any]] = {
    nn.TransformerEncoderLayer: _encoder_layer,
    nn.TransformerEncoder: _encoder,
    nn.TransformerDecoder: _decoder,
    nn.Transformer: _transformer,
    nn.TransformerDecoderLayer: nn.TransformerDecoderLayer.forward,
}
"""torch.nn module classes traced through, and the forward traced for each."""


def traced_forward(m: nn.Module) -> Optional[Callable[..., Any]]:
    """The forward to trace ``m`` with instead of keeping it a leaf, or ``None`` (a leaf).

    Only in training mode (the forwards above are the modules' training paths), and only where
    the class's forward is torch.nn's own (a subclass's ``forward`` is the subclass's business).
    """
    if not m.training:
        return None
    for cls in type(m).__mro__:
        if cls in TRACED:
            return TRACED[cls] if type(m).forward is getattr(cls, "forward") else None
    return None
