"""Attention with the mask eager code would not have built.

Run eagerly, a Hugging Face model without padding calls ``scaled_dot_product_attention`` with
``is_causal=True`` (decoders) or no mask at all (encoders). Traced by ``torch.export`` it cannot
take that shortcut, so the exported graph builds a boolean mask (``[batch, 1, L, S]``) and passes
it: the attention kernel then converts the mask to floats and reads it for every block, where the
causal kernel skips the blocks above the diagonal (on the bench's Llama-style model, about 3% of
a training step).

:func:`attention` is what an exported graph calls instead of the aten op (``fxckpt_attention`` in
``tm.code``). It looks at the mask's values once per mask tensor and calls the aten op as eager
code would have:

* a mask equal to ``ones(L, S).tril()`` on every batch and head: ``is_causal=True``, no mask;
* a mask that is all ``True``: no mask;
* anything else (padding, a float mask, fake or meta tensors, under ``torch.compile``): the mask
  as given.

The kernels give bit-identical outputs and gradients for an all-visible or causal boolean mask
and its shortcut (tested), so this changes speed only.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["attention", "mask_kind"]

_sdpa = torch.ops.aten.scaled_dot_product_attention.default
_local = threading.local()
CAUSAL, FULL = "causal", "full"


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
              is_causal: bool = False, *, scale: Optional[float] = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """``aten.scaled_dot_product_attention`` without a causal or all-visible boolean mask."""
    if attn_mask is not None and not is_causal:
        kind = mask_kind(attn_mask, query.shape[-2], key.shape[-2])
        if kind == CAUSAL:
            attn_mask, is_causal = None, True
        elif kind == FULL:
            attn_mask = None
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                 enable_gqa=enable_gqa)


attention.__module__ = "fxckpt"  # generated code reads `fxckpt_attention(...)`


def mask_kind(mask: torch.Tensor, queries: Any, keys: Any) -> Optional[str]:
    """``"causal"``, ``"full"`` or ``None`` (keep the mask) for a boolean mask over
    ``queries x keys``. The verdict for a mask tensor is remembered until it is written to, so the
    layers of one forward (and its recompute) look at the shared mask once."""
    if (torch.compiler.is_compiling() or type(mask) is not torch.Tensor
            or mask.dtype is not torch.bool
            or mask.device.type == "meta" or mask.dim() < 2
            or tuple(mask.shape[-2:]) != (queries, keys)):
        return None
    try:
        key = (mask._version, mask.data_ptr(), tuple(mask.shape), mask.stride())
    except RuntimeError:  # a functorch-wrapped tensor (vmap, functionalization): no storage
        return None
    seen = getattr(_local, "seen", None)
    if seen is not None and seen[0]() is mask and seen[1] == key:
        return seen[2]
    # Out of sight of dispatch modes: a selective-checkpoint mode counting a kept node's calls
    # must see the same calls in the forward and in the recompute (which finds the verdict here).
    with _disable_current_modes():
        kind = _kind(mask, queries, keys)
    _local.seen = (weakref.ref(mask), key, kind)
    return kind


def _kind(mask: torch.Tensor, queries: int, keys: int) -> Optional[str]:
    if bool(mask.all()):
        return FULL
    causal = torch.ones(queries, keys, dtype=torch.bool, device=mask.device).tril()
    return CAUSAL if torch.equal(mask, causal.expand(mask.shape)) else None
