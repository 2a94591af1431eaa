"""Checkpointing really frees memory: what autograd keeps for backward shrinks as planned."""

from __future__ import annotations

import copy

import torch

import fxckpt
from models import MLP
from support import loss_of


def saved_bytes(module: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward during one forward, deduplicated by storage.

    Segment inputs count: checkpoint saves them outside its own hooks. Parameters do not.
    """
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    loss_of(out).backward()
    return sum(storages.values())


def test_every_4_on_32_layers_keeps_a_quarter_of_eager_plus_boundaries() -> None:
    batch, width = 16, 64
    model = MLP(depth=32, width=width, p=0.1)
    x = torch.randn(batch, width, requires_grad=True)
    eager = saved_bytes(copy.deepcopy(model), x)
    tm = fxckpt.transform(model, every=4, example_inputs=(x,))
    assert len(fxckpt.inspect(tm).plan.segments) == 8
    checkpointed = saved_bytes(tm, x)

    activation = batch * width * 4
    assert checkpointed == 9 * activation  # 8 segment inputs + the head's input
    assert checkpointed <= eager / 4 + 8 * activation
    assert fxckpt.inspect(tm).plan.saved_bytes == 8 * activation


def test_depth_saves_each_block_input_only() -> None:
    model = MLP(depth=8, width=32, p=0.0)
    x = torch.randn(4, 32, requires_grad=True)
    tm = fxckpt.transform(model, depth=2, example_inputs=(x,))
    assert saved_bytes(tm, x) == 9 * 4 * 32 * 4
    assert saved_bytes(copy.deepcopy(model), x) > 2 * 8 * 4 * 32 * 4
