"""FSDP2 (``fully_shard``): how the passes see modules whose parameters FSDP shards.

``fully_shard(block)`` swaps the block's class and registers forward hooks that all-gather its
parameters before its forward and free them after (registering the sharded ``DTensor`` again).
Between calls the block's parameters are shards; the full tensors exist only inside its call.
So fxckpt never reads such a parameter itself -- a captured reference would be a shard, or a
freed full tensor -- it *calls* the module, and the hooks make the parameters whole:

* an FSDP module is opaque (a ``call_module`` node, as every module with hooks), and so is every
  module owning parameters when the model has FSDP modules (the root's ``fully_shard`` swaps
  the parameters of its children too: ``wte``, ``ln_f``, ``lm_head``);
* unlike other hooked modules, an FSDP module whose only hooks are FSDP's may be *inside* a
  recompute segment: running its hooks again during recompute is how FSDP2 composes with
  activation checkpointing (the parameters are gathered again in backward instead of kept);
* a graph captured before ``fully_shard`` is not used after it (:func:`sharding_key`);
* annotate runs on fake tensors with hooks off (no communication): :func:`full_parameters`
  shows it each ``DTensor`` parameter as a plain tensor of the global shape (stride 0, so
  nothing of that size is allocated).

Nothing here imports ``torch.distributed`` unless the model's modules already did.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, cast

import torch

from fxckpt.errors import CaptureError

__all__ = ["is_fsdp", "recomputable", "sharding_key", "parameter_owners", "full_parameters",
           "root_gathered", "share_state"]


def is_fsdp(module: torch.nn.Module) -> bool:
    """True for a module ``torch.distributed.fsdp.fully_shard`` was applied to."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no module can be FSDP
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def recomputable(module: torch.nn.Module) -> bool:
    """An FSDP module whose hooks are all FSDP's own: it may run again in a recompute."""
    if not is_fsdp(module):
        return False
    from torch.distributed.fsdp import fully_shard

    state = cast(Any, fully_shard).state(module)  # contract()'s accessor; the stubs omit it
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values(),
             *module._backward_hooks.values(), *module._backward_pre_hooks.values()]
    return all(getattr(h, "__self__", None) is state for h in hooks)


def sharding_key(model: torch.nn.Module) -> tuple[bool, ...]:
    """Which of ``model``'s modules FSDP manages (the root counts when its hooks are FSDP's).

    A graph captured before ``fully_shard`` reads parameters FSDP has since replaced; comparing
    this key tells the capture is stale. Empty (and free) when FSDP was never imported.
    """
    if "torch.distributed.fsdp" not in sys.modules:
        return ()
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    hooks = [*model._forward_pre_hooks.values(), *model._forward_hooks.values()]
    root = is_fsdp(model) or any(isinstance(getattr(h, "__self__", None), FSDPState)
                                 for h in hooks)
    return (root, *(is_fsdp(m) for m in model.modules()))


def parameter_owners(model: torch.nn.Module) -> tuple[str, ...]:
    """Paths of the non-root modules owning parameters, outside FSDP modules (called opaquely)."""
    owners: list[str] = []
    skip: list[str] = []
    for path, m in model.named_modules():
        if not path or any(path.startswith(s + ".") for s in skip):
            continue
        if is_fsdp(m):
            skip.append(path)
        elif m._parameters:
            owners.append(path)
            skip.append(path)
    return tuple(owners)


@contextlib.contextmanager
def full_parameters(model: torch.nn.Module) -> Iterator[None]:
    """Show every ``DTensor`` parameter as a stride-0 plain tensor of its global shape."""
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    for m in model.modules():
        swapped += [(m, name, p) for name, p in m._parameters.items()
                    if p is not None and _is_dtensor(p)]
    try:
        for m, name, p in swapped:
            full = torch.empty((), dtype=p.dtype, device=p.device).expand(p.shape)
            m._parameters[name] = torch.nn.Parameter(full, requires_grad=p.requires_grad)
        yield
    finally:
        for m, name, p in swapped:
            m._parameters[name] = p


def share_state(model: torch.nn.Module, tm: torch.nn.Module) -> None:
    """Register ``tm`` (sharing ``model``'s ``__dict__``) with the state a composable API
    (``fully_shard``) keeps for ``model``: torch finds that state by module object, so without
    this ``tm.unshard()``, ``tm.reshard()`` and ``tm.to(...)`` of a model sharded before
    ``transform`` fail with "No FSDP state found"."""
    if "torch.distributed._composable_state" not in sys.modules:
        return
    from torch.distributed import _composable_state as composable

    state = composable._get_module_state(model)
    if state is not None and state is not model and composable._get_module_state(tm) is None:
        composable._insert_module_state(tm, state)


@contextlib.contextmanager
def root_gathered(model: torch.nn.Module, live: torch.nn.Module) -> Iterator[None]:
    """The root's own parameters whole while the graph that reads them is captured.

    Inside the root's forward (a training call) FSDP has gathered them already. Outside it
    (``example_inputs=`` or ``plan_for`` after ``fully_shard``) they are shards: the root
    (``live``, the FSDP module ``model`` views) gathers them for the capture, as its forward
    would, and shards them again after. Every rank transforms alike, so the all-gather meets its
    peers. FSDP2 keeps the same unsharded Parameter objects across steps, so a graph holding them
    reads the gathered values at every call.
    """
    sharded = [name for name, p in model._parameters.items() if _is_dtensor(p)]
    if not sharded:
        yield
        return
    if not is_fsdp(live):
        raise CaptureError(
            f"{type(model).__name__}'s own parameters {sharded} are sharded (DTensor), but not by "
            "fully_shard on the model itself, so nothing gathers them for the graph that reads "
            "them. Apply fully_shard to the model (the root), or move these parameters into a "
            "submodule that fully_shard manages"
        )
    fsdp = cast(Any, live)
    fsdp.unshard()
    try:
        yield
    finally:
        fsdp.reshard()


def _is_dtensor(t: object) -> bool:
    tensor = sys.modules.get("torch.distributed.tensor")  # not imported: nothing is a DTensor
    return tensor is not None and isinstance(t, tensor.DTensor)
