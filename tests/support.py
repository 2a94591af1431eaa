"""Helpers shared by the tests: run one training step and collect everything it produced."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
import torch.utils._pytree as pytree


@dataclasses.dataclass
class Step:
    out: list[torch.Tensor]
    input_grads: list[torch.Tensor | None]
    param_grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    other_out: list[Any]


def loss_of(out: Any) -> torch.Tensor:
    """Sum of squares of every floating tensor in the output (any structure)."""
    leaves = [
        t
        for t in pytree.tree_leaves(_plain(out))
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    return sum(t.float().pow(2).sum() for t in leaves)


def _plain(out: Any) -> Any:
    return dict(out) if hasattr(out, "keys") and not isinstance(out, dict) else out


def clone_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def c(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return t.detach().clone().requires_grad_(t.requires_grad)
        return t

    return pytree.tree_map(c, (args, kwargs))


def run_step(module: torch.nn.Module, args: tuple, kwargs: dict, seed: int = 0) -> Step:
    """Seed, run forward and backward, and collect outputs, grads and buffers."""
    args, kwargs = clone_inputs(args, kwargs)
    torch.manual_seed(seed)
    out = module(*args, **kwargs)
    loss_of(out).backward()
    leaves = pytree.tree_leaves(_plain(out))
    tensors_in = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    return Step(
        out=[t.detach() for t in leaves if isinstance(t, torch.Tensor)],
        input_grads=[t.grad for t in tensors_in if t.requires_grad],
        param_grads={k: p.grad for k, p in module.named_parameters()},
        buffers={k: b.clone() for k, b in module.named_buffers()},
        other_out=[x for x in leaves if not isinstance(x, torch.Tensor)],
    )


def assert_steps_equal(a: Step, b: Step) -> None:
    """Bit-identical outputs, input grads, parameter grads and buffers."""
    assert len(a.out) == len(b.out) and a.other_out == b.other_out
    for x, y in zip(a.out, b.out):
        assert torch.equal(x, y), "outputs differ"
    assert len(a.input_grads) == len(b.input_grads)
    for x, y in zip(a.input_grads, b.input_grads):
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (
            "input grads differ"
        )
    assert a.param_grads.keys() == b.param_grads.keys()
    for k in a.param_grads:
        x, y = a.param_grads[k], b.param_grads[k]
        assert (x is None) == (y is None), f"grad of {k}: {x is None} vs {y is None}"
        assert x is None or torch.equal(x, y), f"grad of {k} differs"
    assert a.buffers.keys() == b.buffers.keys()
    for k in a.buffers:
        assert torch.equal(a.buffers[k], b.buffers[k]), f"buffer {k} differs"


class Slow(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` in its forward and ``backward_s`` in its backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        time.sleep(ctx.backward_s)
        return grad, None, None
