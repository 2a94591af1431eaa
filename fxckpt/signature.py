"""Input signatures: when a new plan is needed, and how to call a captured graph.

A captured graph is specialised to the shapes, dtypes and devices of the tensors it was captured
with, and to the values of its non-tensor arguments (``None`` masks, ``return_dict=False``, a
``scale`` of 3). The transformed module keeps one plan per :func:`signature_key`, so a call that
differs in any of those re-plans instead of running a graph built for other inputs.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Hashable

import torch
import torch.utils._pytree as pytree

__all__ = ["signature_key", "describe_signature", "bind_positional", "is_static_value"]


def signature_key(training: bool, args: tuple, kwargs: dict) -> Hashable:
    """A hashable key of everything a captured graph is specialised to."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return (training, str(spec), tuple(_leaf_key(x) for x in leaves))


def _leaf_key(x: Any) -> Hashable:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype, x.device.type, x.device.index)
    try:
        hash(x)
    except TypeError:
        return ("object", type(x).__qualname__, id(x))
    return ("value", type(x).__qualname__, x)


def describe_signature(args: tuple, kwargs: dict) -> str:
    """``(x: f32[8, 64], mask=None)`` for plans and log lines."""
    parts = [_describe(a) for a in args]
    parts += [f"{k}={_describe(v)}" for k, v in kwargs.items()]
    return "(" + ", ".join(parts) + ")"


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        dtype = str(x.dtype).replace("torch.", "")
        dev = "" if x.device.type == "cpu" else f" @{x.device}"
        return f"{dtype}{list(x.shape)}{dev}"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in x.items()) + "}"
    if isinstance(x, (list, tuple)):
        inner = ", ".join(_describe(v) for v in x)
        return f"[{inner}]" if isinstance(x, list) else f"({inner})"
    return repr(x)


def bind_positional(fn: Callable, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """Bind a call to ``fn``'s signature with defaults applied (raises ``TypeError`` if it can't)."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def is_static_value(x: Any) -> bool:
    """True for an argument that holds no tensor (it can be baked into a traced graph)."""
    return not any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(x))
