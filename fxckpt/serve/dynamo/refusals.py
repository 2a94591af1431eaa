"""What the Dynamo path refuses, or runs unplanned, said by name: a model sharded with FSDP2,
a ``random.Random`` the forward draws from, and the places Dynamo does not compile (a user's
dispatch mode, torch.func transforms)."""

from __future__ import annotations

import random
from typing import Any

import torch

from fxckpt.capture import generators
from fxckpt.errors import CaptureError, ConfigError

__all__ = ["refuse_fsdp", "refuse_python_draws", "sharded", "uncompiled_here"]


def sharded(tm: torch.nn.Module) -> list[str]:
    """The modules of ``tm`` managed by FSDP2's ``fully_shard`` (``<root>`` for ``tm``)."""
    from torch.distributed.fsdp import FSDPModule

    return [name or "<root>" for name, m in tm.named_modules() if isinstance(m, FSDPModule)]


def refuse_fsdp(tm: torch.nn.Module) -> None:
    """FSDP2's hooks are skipped by Dynamo (``skip_fsdp_hooks``): every ``fully_shard`` module
    runs uncompiled, its inner frames as graphs of one layer each, and nothing is saved. Refused
    by name at the first training call with ``capture="dynamo"`` (``auto`` captures one whole
    graph for such a model)."""
    managed = sharded(tm)
    if managed:
        raise ConfigError(
            f"capture='dynamo' cannot plan a model sharded with fully_shard ({managed[0]} is): "
            "Dynamo runs each FSDP2 module's call uncompiled, so its graphs hold one layer each "
            "and checkpointing would save nothing. Use capture='auto', which captures one whole "
            "graph of a sharded model (fxckpt and FSDP2 work in both orders: "
            "docs/distributed.md)")


def refuse_python_draws(held: list[tuple[str, random.Random, Any]]) -> None:
    """A ``random.Random`` the model holds and draws from is replayed wrongly by Dynamo after
    the first call (torch 2.13: ``torch.compile(backend="eager")`` alone diverges at the second
    call): refused at the first call that draws, the generator put back."""
    for path, generator, state in held:
        if not generators.same_state(generators.state_of(generator), state):
            for _, g, s in held:
                generators.set_state(g, s)
            raise CaptureError(
                f"{generators.describe(path, generator)}, and draws from it: Dynamo replays a "
                "random.Random's draws wrongly after the first call. Draw with torch "
                "(torch.rand, or a torch.Generator the model owns) or numpy, or transform with "
                "capture='graph', which refuses it too")


def uncompiled_here() -> str:
    """What makes Dynamo run a frame uncompiled here, in words, or ``""``: a user's dispatch
    mode (Dynamo's own test), or torch.func transforms."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in _get_current_dispatch_mode_stack():
        if not mode.is_infra_mode() and not mode.ignore_compile_internals():
            return f"a TorchDispatchMode ({type(mode).__name__})"
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return "torch.func transforms (vmap, grad, jacrev)"
    return ""
