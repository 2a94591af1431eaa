"""Attributes the model's forward assigns (``self.attn_map = attn.detach()``), set every call.

A captured graph holds tensor operations only, so an assignment the forward made while it was
traced would never happen again: the attribute would be missing on the model (a later read
raises ``AttributeError``) or stale. Capture turns each such assignment into a call of
:func:`assign` at the point the value exists, so the rewritten forward sets it as the model's
forward does, once per call:

    attn = softmax(scores)
    fxckpt_assign(self.fxckpt_assign_0, attn)     # blocks.0.attn_map = attn

It does nothing while a segment is recomputed in backward (the forward already set it) or while
fxckpt runs the graph on fake tensors to plan it. Modules are held weakly: a graph never keeps
a model alive.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import is_fake
from torch.fx.node import has_side_effect

from fxckpt.runtime.checkpoint import is_recomputing

__all__ = ["Assignment", "assign"]


class Assignment:
    """Where a value goes: attribute ``name`` of a module (held weakly)."""

    def __init__(self, module: torch.nn.Module, name: str, where: str) -> None:
        self.module = weakref.ref(module)
        self.name = name
        self.where = where
        """``blocks.0.attn_map``, for messages."""

    def __repr__(self) -> str:
        return f"Assignment({self.where})"


@has_side_effect
def assign(target: Assignment, value: Any) -> None:
    """Set ``target`` to ``value`` (see the module docstring for when it does nothing)."""
    if is_recomputing():
        return
    if any(isinstance(t, torch.Tensor) and is_fake(t) for t in pytree.tree_leaves(value)):
        return
    module = target.module()
    if module is not None:
        setattr(module, target.name, value)


# Generated code reads `fxckpt_assign(fxckpt_assign_0, attn)`.
assign.__module__ = "fxckpt"
