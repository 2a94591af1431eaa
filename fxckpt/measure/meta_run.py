"""Steps whose tensors are all on ``meta`` run on meta twins instead of fake tensors.

Verification (:mod:`fxckpt.measure.verify`) runs a training step on fake tensors: a
``FakeTensorMode`` wraps each tensor in a :class:`~torch._subclasses.fake_tensor.FakeTensor`,
which pretends to be on the tensor's device and computes with a meta tensor inside. For a
model planned on the meta device (:doc:`docs/meta.md`) the pretended device *is* ``meta``: the
mode then adds nothing but its Python dispatch (a cache key and a new wrapper per op, about two
thirds of the step's time on a 70B Llama). Such a step runs on meta twins of the parameters,
buffers and inputs instead: the same aten calls reach the same meta kernels, make storages of
the same sizes, and the tracker counts them as it counts a fake step's (the device of both is
``meta``).

Only where nothing tells the two apart:

* every parameter, buffer and tensor attribute of the root module and every input is on meta;
* no graph under the root makes tensors on another device (a meta twin would compute a real
  one; a fake tensor computes none), nor sets a model's attribute
  (:func:`fxckpt.runtime.assign.assign` skips fake values only).

A step that fails on meta tensors (an op without a meta kernel, a loss's constant on the CPU)
runs again on fake tensors, whose failures are the ones reported.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from fxckpt.runtime.assign import assign

__all__ = ["on_meta", "meta_twin", "fake_twin"]

_MOVES = ("cpu", "cuda", "numpy", "tolist", "item")
"""Tensor methods that leave meta (or read values) in a symbolically traced graph."""


def on_meta(root: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """Can a step of ``root`` on these inputs run on meta twins (module docstring)?"""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    for module in root.modules():
        tensors += [t for t in module._parameters.values() if t is not None]
        tensors += [t for t in module._buffers.values() if t is not None]
        tensors += [v for v in module.__dict__.values() if isinstance(v, torch.Tensor)]
    if not tensors or any(t.device.type != "meta" for t in tensors):
        return False
    return not any(_elsewhere(n) for m in root.modules() if isinstance(m, torch.fx.GraphModule)
                   for n in m.graph.nodes)


def _elsewhere(node: torch.fx.Node) -> bool:
    """``node`` sets an attribute, moves to or names a device other than meta."""
    if node.op not in ("call_function", "call_method"):
        return False
    if node.target is assign or node.target in _MOVES:
        return True
    found = False

    def check(value: Any) -> Any:
        nonlocal found
        if isinstance(value, (torch.device, str)) and _other_device(value):
            found = True
        return value

    torch.fx.node.map_aggregate((node.args, node.kwargs), check)
    return found


def _other_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type != "meta"
    try:
        return torch.device(value).type != "meta"
    except (RuntimeError, TypeError):
        return False  # a string that is not a device


def meta_twin(t: torch.Tensor) -> torch.Tensor:
    """A new leaf on ``t``'s storage, wanting a gradient as ``t`` does (a parameter stays one),
    with its own version counter and ``.grad``: what a step does to it leaves ``t`` as it was."""
    with torch.no_grad():
        twin = torch.empty(0, dtype=t.dtype, device=t.device).set_(
            t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(twin, t.requires_grad)
    return twin.requires_grad_(t.requires_grad)


def fake_twin(mode: Any, t: torch.Tensor) -> torch.Tensor:
    """``mode.from_tensor(t)``; a one-element CPU tensor keeps its value for ``.item()``, as a
    Dynamo graph reads an unspecialised float input (a schedule's value) from one. A tensor with
    autograd history (an earlier Dynamo graph's output) becomes a clone of a new fake leaf: a
    fake step's backward stops there, as the graph's does at its inputs."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if t.requires_grad and not t.is_leaf:  # an earlier graph's output: a step starts here
        return mode.from_tensor(t.detach()).requires_grad_().clone()
    fake = mode.from_tensor(t)
    if t.numel() == 1 and t.device.type == "cpu" and not t.requires_grad \
            and type(t) is torch.Tensor:
        with unset_fake_temporarily():  # the real value, read outside any fake mode
            fake.item_memo = t.item()
    return fake
