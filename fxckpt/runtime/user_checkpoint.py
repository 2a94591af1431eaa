"""A model's own ``torch.utils.checkpoint(..., use_reentrant=True)`` call, as eager runs it.

Dynamo captures every ``torch.utils.checkpoint`` call as one ``tag_activation_checkpoint`` op
whose body takes the call's inputs and, after them, the parameters the checkpointed function
reads; run eagerly, that op is the non-reentrant checkpoint. Eager's reentrant checkpoint
differs in one way a gradient can see: an autograd ``Function`` over the call's inputs only, so
when none of them requires grad (the first block of a model whose input is data) its output does
not either, and nothing inside the call gets a gradient (torch warns: "None of the inputs have
requires_grad=True"). :func:`reentrant` keeps that: such a call runs its body under
``no_grad``, with torch's warning; any other call runs the op as captured (the same values, the
same gradients).

Parameters reach the op as ``nn.Parameter`` objects, so they are told from the call's inputs at
run time; a parameter passed as an input of the call itself counts as read, not as an input.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

__all__ = ["reentrant"]


def reentrant(body: torch.nn.Module, *operands: Any, **kwargs: Any) -> Any:
    """A captured ``checkpoint(..., use_reentrant=True)`` call (see the module docstring)."""
    inputs = [t for t in operands
              if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)]
    if torch.is_grad_enabled() and not any(t.requires_grad for t in inputs):
        warnings.warn("None of the inputs have requires_grad=True. Gradients will be None",
                      stacklevel=1)
        with torch.no_grad():
            return body(*operands)
    return torch.ops.higher_order.tag_activation_checkpoint(body, *operands, **kwargs)
