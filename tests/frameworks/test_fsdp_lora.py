"""LoRA under FSDP2 with frozen base parameters, checkpointed by fxckpt, on 2 gloo ranks.

The pain this guards against (transformers #47254): non-reentrant checkpointing of a LoRA model
sharded by ZeRO-3 / FSDP, whose frozen base weights are freed between forward and backward, raised
``torch.utils.checkpoint.CheckpointError`` in the recompute (a saved tensor of shape ``[1024]``
recomputed as ``[0]``). fxckpt calls each FSDP-sharded decoder layer as a module, so in backward
FSDP gathers the layer's parameters again before the recompute reads them.

A tiny Llama gets PEFT LoRA adapters (``get_peft_model``: every base weight frozen, adapters with
dropout on), each decoder layer and the root are ``fully_shard``-ed, and 3 AdamW steps train the
adapters, each rank on its half of the batch. In both orders fxckpt supports (transform, then
shard; shard, then transform), every loss, every adapter gradient (gathered from its shards) and
every adapter weight after the steps must equal, bit for bit, the same FSDP2 run without fxckpt;
the frozen weights must stay as they were, without gradients; and each decoder layer must run
twice per step (its forward, then its recompute), so the test cannot pass without checkpointing.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

import fxckpt
import gloo

pytest.importorskip("peft")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.frameworks, pytest.mark.slow]

STEPS, LAYERS = 3, 2
LAYER_PATHS = [(f"base_model.model.model.layers.{i}",) for i in range(LAYERS)]
DEPTH = 5  # base_model . model . model . layers . i


def _lora_llama() -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=32, use_cache=False)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                      target_modules=["q_proj", "v_proj", "up_proj"],
                      init_lora_weights=False)  # B != 0: both adapter matrices get gradients
    return get_peft_model(LlamaForCausalLM(cfg), lora)


def _shard(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


ORDERS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "transform, then fully_shard": lambda m: _shard(fxckpt.transform(m, depth=DEPTH)),
    "fully_shard, then transform": lambda m: fxckpt.transform(_shard(m), depth=DEPTH),
}


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


class Run:
    """What one training run produced, gathered whole from the shards."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.layer_calls: list[int] = []
        self.trained: dict[str, torch.Tensor] = {}
        self.frozen: dict[str, torch.Tensor] = {}


def _train(model: nn.Module, batches: list[torch.Tensor], rank: int, world: int,
           calls: list[int]) -> Run:
    from torch.utils.checkpoint import CheckpointError

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    run = Run()
    torch.manual_seed(100 + rank)  # LoRA dropout: the same masks in the run it is compared with
    for step, ids in enumerate(batches):
        part = ids.chunk(world)[rank]
        calls[0] = 0
        try:
            loss = model(input_ids=part, labels=part).loss
            loss.backward()
        except CheckpointError as e:  # the failure of transformers #47254
            pytest.fail(f"rank {rank}, step {step}: checkpointing broke under FSDP2: {e}")
        run.layer_calls.append(calls[0])
        run.losses.append(loss.detach().clone())
        run.grads.append({n: _whole(p.grad) for n, p in model.named_parameters()
                          if p.requires_grad})
        opt.step()
        opt.zero_grad(set_to_none=True)
    for name, p in model.named_parameters():
        if p.requires_grad:
            run.trained[name] = _whole(p)
        else:
            assert p.grad is None, f"frozen {name} got a gradient"
            run.frozen[name] = _whole(p)
    return run


def _count_layer_calls(calls: list[int]) -> None:
    """Count LlamaDecoderLayer forward runs (this spawned process only): FSDP's sharded layers
    are called as modules, never traced through, so a recompute runs this forward again."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    own = LlamaDecoderLayer.forward

    @functools.wraps(own)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return own(self, *args, **kwargs)

    LlamaDecoderLayer.forward = forward


def _assert_same(got: Run, want: Run, what: str) -> None:
    for step, (g, w) in enumerate(zip(got.losses, want.losses, strict=True)):
        assert torch.equal(g, w), f"{what}, step {step}: loss {g} != {w}"
    for step, (gs, ws) in enumerate(zip(got.grads, want.grads, strict=True)):
        assert gs.keys() == ws.keys() and len(ws) == 3 * 2 * LAYERS, (what, sorted(ws))
        for name in ws:
            assert torch.equal(gs[name], ws[name]), f"{what}, step {step}: grad of {name} differs"
    assert got.trained.keys() == want.trained.keys()
    for name in want.trained:
        assert torch.equal(got.trained[name], want.trained[name]), f"{what}: {name} differs"


def _lora_under_fsdp(rank: int, world: int) -> None:
    calls = [0]
    _count_layer_calls(calls)
    torch.manual_seed(0)
    model = _lora_llama()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    batches = [torch.randint(0, 64, (4, 16)) for _ in range(STEPS)]

    plain = _train(_shard(copy.deepcopy(model)), batches, rank, world, calls)
    assert plain.layer_calls == [LAYERS] * STEPS
    assert plain.frozen.keys() | plain.trained.keys() == initial.keys()
    for name, value in plain.frozen.items():
        assert torch.equal(value, initial[name]), f"frozen {name} changed"
    assert all(not torch.equal(v, initial[n]) for n, v in plain.trained.items())

    for what, build in ORDERS.items():
        tm = build(copy.deepcopy(model))
        got = _train(tm, batches, rank, world, calls)
        segments = [s.module_paths for s in fxckpt.inspect(tm).plan.segments if s.module_paths]
        assert segments == LAYER_PATHS, f"{what}: {segments}"
        # The first step also captures (the capture calls each sharded layer too).
        runs = got.layer_calls
        assert runs[1:] == [2 * LAYERS] * (STEPS - 1) and runs[0] >= 2 * LAYERS, (what, runs)
        _assert_same(got, plain, what)
        for name, value in got.frozen.items():
            assert torch.equal(value, plain.frozen[name]), f"{what}: frozen {name} changed"


def test_lora_under_fsdp2_trains_like_fsdp2_alone() -> None:
    gloo.run(_lora_under_fsdp)
