"""FSDP2 (``fully_shard``) and fxckpt on plain ``nn.Module`` models and on a Hugging Face one.

Each test is one model kind in one order, on 2 gloo ranks: fxckpt's ``transform`` before
``fully_shard`` (as torchtitan applies activation checkpointing before FSDP) or after it, with
and without ``example_inputs``, and in each with ``every``, ``depth``, a budget fraction and a
budget in bytes the unmodified step fits. Every gradient (gathered whole from its shards) after
each of two AdamW steps must equal, bit for bit, the same FSDP2 run without fxckpt, and under
``depth`` each sharded block must run twice per step (forward, then recompute).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

import fxckpt
import gloo

pytestmark = [pytest.mark.frameworks, pytest.mark.slow]

STEPS = 2


class CountedLinear(nn.Linear):
    """A Linear that counts its forward runs (the blocks' first op: a recompute runs it again)."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CountedLinear.calls += 1
        return super().forward(x)


def _mlp() -> nn.Module:
    """The shape users reported: 4 blocks, each an ``nn.Sequential`` of Linear and GELU."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(CountedLinear(64, 64), nn.GELU()) for _ in range(4)])


class Net(nn.Module):
    """A root with a parameter of its own, blocks in a ModuleList and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.ones(64))
        self.blocks = nn.ModuleList(nn.Sequential(CountedLinear(64, 128), nn.GELU(),
                                                  nn.Linear(128, 64)) for _ in range(4))
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x * self.scale)
        return self.head(x)


def _llama() -> nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()


class Kind:
    """A model kind: how to build it, its blocks, a batch, its loss and its depth strategy."""

    def __init__(self, make: Callable[[], nn.Module], blocks: Callable[[nn.Module], Any],
                 batch: Callable[[], torch.Tensor],
                 loss: Callable[[nn.Module, torch.Tensor], torch.Tensor], depth: int) -> None:
        self.make, self.blocks, self.batch = make, blocks, batch
        self.loss, self.depth = loss, depth


KINDS = {
    "sequential_mlp": Kind(_mlp, lambda m: list(m), lambda: torch.randn(512, 64),
                           lambda m, x: m(x).square().mean(), depth=1),
    "module_with_root_parameter": Kind(Net, lambda m: list(m.blocks), lambda: torch.randn(512, 64),
                                       lambda m, x: m(x).square().mean(), depth=2),
    "hf_llama": Kind(_llama, lambda m: list(m.model.layers),
                     lambda: torch.randint(0, 128, (4, 32)),
                     lambda m, ids: m(input_ids=ids, labels=ids).loss, depth=3),
}


def _shard(kind: Kind, model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in kind.blocks(model):
        fully_shard(block)
    fully_shard(model)
    return model


def _example(kind: Kind, world: int) -> torch.Tensor:
    return kind.batch().chunk(world)[0]


ORDERS: dict[str, Callable[[Kind, nn.Module, dict, int], nn.Module]] = {
    "transform_then_shard": lambda k, m, o, w: _shard(k, fxckpt.transform(m, **o)),
    "transform_with_example_then_shard": lambda k, m, o, w: _shard(
        k, fxckpt.transform(m, example_inputs=(_example(k, w),), **o)),
    "shard_then_transform": lambda k, m, o, w: fxckpt.transform(_shard(k, m), **o),
    "shard_then_transform_with_example": lambda k, m, o, w: fxckpt.transform(
        _shard(k, m), example_inputs=(_example(k, w),), **o),
}


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _train(kind: Kind, model: nn.Module, batches: list[torch.Tensor], rank: int,
           world: int, calls: list[int]) -> list[dict[str, torch.Tensor]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads = []
    for x in batches:
        calls.clear()
        kind.loss(model, x.chunk(world)[rank]).backward()
        calls.append(CountedLinear.calls)
        grads.append({n: _whole(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads


def _count_llama_layers() -> None:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    own = LlamaDecoderLayer.forward

    @functools.wraps(own)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        CountedLinear.calls += 1
        return own(self, *args, **kwargs)

    LlamaDecoderLayer.forward = forward


def _case(rank: int, world: int, kind_name: str, order: str) -> None:
    kind = KINDS[kind_name]
    if kind_name == "hf_llama":
        _count_llama_layers()
    torch.manual_seed(1)
    batches = [kind.batch() for _ in range(STEPS)]
    calls: list[int] = []
    plain = _train(kind, _shard(kind, kind.make()), batches, rank, world, calls)
    blocks = len(kind.blocks(kind.make()))
    for options in ({"every": 2}, {"depth": kind.depth}, {"budget": 0.7}, {"budget": "1GiB"}):
        what = f"{kind_name}, {order}, {options}"
        tm = ORDERS[order](kind, kind.make(), options, world)
        CountedLinear.calls = 0
        got = _train(kind, tm, batches, rank, world, calls)
        for step, (g, p) in enumerate(zip(got, plain, strict=True)):
            assert g.keys() == p.keys(), what
            for name in p:
                assert torch.equal(g[name], p[name]), f"{what}, step {step}: grad of {name}"
        if order.startswith("shard"):  # torch finds FSDP's state for the transformed module
            tm.unshard()  # type: ignore[operator]
            tm.reshard()  # type: ignore[operator]
        if "depth" in options:
            CountedLinear.calls = 0
            kind.loss(tm, batches[0].chunk(world)[rank]).backward()
            assert CountedLinear.calls == 2 * blocks, (what, CountedLinear.calls)
            paths = [s.module_paths for s in fxckpt.inspect(tm).plan.segments]
            assert len(paths) == blocks, (what, paths)


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_fsdp2_with_fxckpt_trains_like_fsdp2_alone(kind: str, order: str) -> None:
    if kind == "hf_llama":
        pytest.importorskip("transformers")
    gloo.run(_case, kind, order)


def _dynamo_refused(rank: int, world: int, order: str) -> None:
    kind = KINDS["sequential_mlp"]
    options = {"capture": "dynamo", "every": 2}
    if order == "shard_then_transform":
        tm = fxckpt.transform(_shard(kind, kind.make()), **options)
    else:
        tm = _shard(kind, fxckpt.transform(kind.make(), **options))
    with pytest.raises(fxckpt.ConfigError, match=r"capture='dynamo' cannot plan a model sharded "
                       r"with fully_shard \(<root> is\).* Use capture='auto'"):
        kind.loss(tm, _example(kind, world))


@pytest.mark.parametrize("order", ["shard_then_transform", "transform_then_shard"])
def test_fsdp2_on_the_dynamo_path_is_refused_by_name(order: str) -> None:
    """Dynamo skips FSDP2's hooks: each sharded block would run uncompiled and nothing would be
    saved, so the first training call says so and names the path that works."""
    gloo.run(_dynamo_refused, order)
