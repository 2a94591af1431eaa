"""Attention as eager code would have run it.

Run eagerly, a Hugging Face model without padding calls ``scaled_dot_product_attention`` with
``is_causal=True`` (decoders) or no mask at all (encoders), and with ``enable_gqa=True`` where
there are fewer key/value heads than heads. Traced by ``torch.export`` it cannot take those
branches (they depend on whether the mask is ``None``), so the exported graph builds a boolean
mask (``[batch, 1, L, S]``), repeats the key/value heads (``repeat_kv``) and passes both: the
kernel then converts the mask to floats and reads it for every block, where the causal kernel
skips the blocks above the diagonal, and the gradients of grouped heads are summed in another
order than eager's.

:func:`attention` is what an exported graph calls instead of the aten op (``fxckpt_attention`` in
``tm.code``; :mod:`fxckpt.capture.simplify` rewrites the calls). It looks at the mask's values
once per mask tensor and calls the aten op as eager code would have:

* a mask equal to ``ones(L, S).tril()`` on every batch and head: ``is_causal=True``, no mask;
* a mask that is all ``True``: no mask;
* anything else (padding, a float mask, under ``torch.compile``): the mask as given;
* ``kv_repeats=n`` (the graph's ``repeat_kv`` folded into the call): without a mask,
  ``enable_gqa=True`` on the unrepeated heads (as Hugging Face's eager attention does when the
  head size is at most 256), else the heads repeated here, by the ops the graph had.

Fake and meta tensors (planning, verification) have no values to look at: they follow
``expect``, the verdict :mod:`fxckpt.capture.simplify` found for the mask at the example's shapes
when the mask depends on shapes only, so the plan models the kernels a real step runs.

A causal or all-visible boolean mask and its shortcut give bit-identical outputs and gradients
(tested), so dropping the mask changes speed only; ``enable_gqa`` is what eager runs.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from fxckpt import integrations

__all__ = ["attention", "layer_mask", "mask_kind", "kind_of", "planning", "CAUSAL", "FULL"]

_sdpa = torch.ops.aten.scaled_dot_product_attention.default
_local = threading.local()
CAUSAL, FULL = "causal", "full"


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
              is_causal: bool = False, *, scale: Optional[float] = None,
              enable_gqa: bool = False, kv_repeats: int = 1,
              expect: Optional[str] = None) -> torch.Tensor:
    """``aten.scaled_dot_product_attention`` as eager code would call it (module docstring)."""
    if attn_mask is not None and not is_causal:
        kind = expect if _valueless(attn_mask) else mask_kind(
            attn_mask, query.shape[-2], key.shape[-2])
        if kind == CAUSAL:
            attn_mask, is_causal = None, True
        elif kind == FULL:
            attn_mask = None
    if kv_repeats > 1:
        limit = integrations.gqa_head_limit()  # Hugging Face's eager attention: 256
        if attn_mask is None and key.shape[-1] == value.shape[-1] <= limit:
            enable_gqa = True
        else:
            key, value = _repeat(key, kv_repeats), _repeat(value, kv_repeats)
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                 enable_gqa=enable_gqa)


attention.__module__ = "fxckpt"  # generated code reads `fxckpt_attention(...)`


def layer_mask(mask: Any, causal: bool) -> Any:
    """The ``attention_mask`` a Hugging Face layer called as it is (sharded by FSDP, hooked)
    gets, as eager code would have given it: ``None`` where the boolean mask an exported graph
    built is one eager code skips (causal, for a layer whose attention is causal; all visible, for
    a non-causal one or a single query), so the layer's own attention takes the same kernel path
    (``is_causal=True`` or no mask) as eager; else the mask as it is. Fake and meta masks stay."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or _valueless(mask):
        return mask
    kind = mask_kind(mask, mask.shape[-2], mask.shape[-1])
    if kind == CAUSAL and causal or kind == FULL and (not causal or mask.shape[-2] == 1):
        return None
    return mask


layer_mask.__module__ = "fxckpt"  # generated code reads `fxckpt_layer_mask(...)`


_PLANNING = [False]
"""Whether fxckpt is planning a graph inside its Dynamo backend (:func:`planning`): a plain
global, which code Dynamo traces can read without a graph break (a ``ContextVar`` cannot)."""


@contextlib.contextmanager
def planning() -> Iterator[None]:
    """Fake runs in here are fxckpt's own (planning a graph Dynamo handed its backend): they
    follow ``expect`` although Dynamo is compiling."""
    before, _PLANNING[0] = _PLANNING[0], True
    try:
        yield
    finally:
        _PLANNING[0] = before


def _valueless(mask: torch.Tensor) -> bool:
    """Fake or meta: shapes only (not under ``torch.compile``, whose tensors are real, unless the
    run is fxckpt's own planning inside its Dynamo backend)."""
    return (isinstance(mask, FakeTensor) or mask.device.type == "meta") and (
        not torch.compiler.is_compiling() or _PLANNING[0])


def _repeat(x: torch.Tensor, n: int) -> torch.Tensor:
    """``repeat_kv``: ``[b, h, s, d]`` -> ``[b, h * n, s, d]``, each head ``n`` times in a row."""
    b, h, s, d = x.shape
    return x.unsqueeze(2).expand(b, h, n, s, d).reshape(b, h * n, s, d)


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
        kind = kind_of(mask, queries, keys)
    _local.seen = (weakref.ref(mask), key, kind)
    return kind


def kind_of(mask: torch.Tensor, queries: int, keys: int) -> Optional[str]:
    """``"causal"``, ``"full"`` or ``None`` for a boolean mask with values, looked at now (no
    memory of earlier verdicts; capture calls it on a mask it computed from sizes, also while
    Dynamo compiles)."""
    if bool(mask.all()):
        return FULL
    causal = torch.ones(queries, keys, dtype=torch.bool, device=mask.device).tril()
    return CAUSAL if torch.equal(mask, causal.expand(mask.shape)) else None
