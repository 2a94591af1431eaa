"""The mask handling of torch.nn's transformer modules, as calls a captured graph can hold.

``nn.TransformerEncoder`` and its relatives check and convert their masks with Python that
branches on tensors (a mask's dtype, whether a float mask equals the causal one), which
``symbolic_trace`` cannot follow. :mod:`fxckpt.capture.nn_modules` traces those modules through
and puts these functions in the graph as single calls (``fxckpt_canonical_mask``,
``fxckpt_causal_hint`` in ``tm.code``); each runs torch's own code on the real tensors of every
call, so the model computes what its eager forward computes.

Fake and meta tensors (planning, verification) have no values: :func:`causal_hint` says "not
causal" for them, so the plan models the attention of an explicit mask.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.nn.modules import transformer as _transformer

__all__ = ["canonical_mask", "causal_hint", "check_transformer_inputs"]


def canonical_mask(mask: torch.Tensor, name: str, other: Optional[torch.Tensor],
                   other_name: str, like: torch.Tensor,
                   check_other: bool = True) -> Optional[torch.Tensor]:
    """``F._canonical_mask`` as torch.nn's transformer modules call it: a boolean mask becomes
    an additive float mask of ``like``'s dtype (checked against ``other``'s dtype)."""
    return F._canonical_mask(
        mask=mask, mask_name=name, other_type=F._none_or_dtype(other), other_name=other_name,
        target_type=like.dtype, check_other=check_other,
    )


def causal_hint(mask: torch.Tensor, src: torch.Tensor, batch_first: bool) -> bool:
    """Whether ``mask`` is the causal mask for ``src``'s sequence length, as
    ``nn.TransformerEncoder`` / ``nn.TransformerDecoder`` decide when ``is_causal`` is ``None``."""
    if is_fake(mask) or mask.device.type == "meta":
        return False  # no values to compare (module docstring)
    size = _transformer._get_seq_len(src, batch_first)
    return _transformer._detect_is_causal_mask(mask, None, size)


def check_transformer_inputs(src: torch.Tensor, tgt: torch.Tensor, batch_first: bool,
                             d_model: int) -> None:
    """``nn.Transformer.forward``'s checks of ``src`` and ``tgt``, with its messages."""
    is_batched = src.dim() == 3
    batch = 0 if batch_first else 1
    if is_batched and src.size(batch) != tgt.size(batch):
        raise RuntimeError("the batch number of src and tgt must be equal")
    if src.size(-1) != d_model or tgt.size(-1) != d_model:
        raise RuntimeError("the feature number of src and tgt must be equal to d_model")
