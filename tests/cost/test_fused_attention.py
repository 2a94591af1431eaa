"""cost/fused_attention.py: attention planned on the meta device as the fused kernel a GPU runs,
replayed in the recompute, and the kernel's seeding tag read with its dropout."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import fxckpt
from fxckpt.cost.fused_attention import fused_attention, no_dropout, plans_fused
from fxckpt.module import dispatcher_of

B, H, KV, L, D = 1, 8, 2, 1024, 32


def _saved_bytes(fn) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def _qkv(device: str, kv: int = H) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    make = lambda h: torch.randn(B, h, L, D, device=device, dtype=torch.bfloat16,  # noqa: E731
                                 requires_grad=True)
    return make(H), make(kv), make(kv)


def test_only_meta_plans_for_a_gpu_profile_are_fused() -> None:
    assert plans_fused("h100", "meta") and plans_fused("a100", "meta")
    assert not plans_fused("h100", "cpu") and not plans_fused(None, "meta")
    assert not plans_fused("cpu", "meta")


@pytest.mark.parametrize("call", ["functional", "aten"])
@pytest.mark.parametrize("mask", [None, "bool"])
def test_meta_attention_keeps_a_logsumexp_not_the_probabilities(call: str, mask) -> None:
    q, k, v = _qkv("meta")
    m = torch.ones(B, 1, L, L, dtype=torch.bool, device="meta") if mask else None
    sdpa = (F.scaled_dot_product_attention if call == "functional"
            else torch.ops.aten.scaled_dot_product_attention.default)
    math = _saved_bytes(lambda: sdpa(q, k, v, m, is_causal=m is None))
    with fused_attention():
        out = sdpa(q, k, v, m, is_causal=m is None)
        fused = _saved_bytes(lambda: sdpa(q, k, v, m, is_causal=m is None))
    assert out.shape == (B, H, L, D) and out.dtype == torch.bfloat16
    probabilities = B * H * L * L * 2
    assert math >= probabilities  # the math keeps the attention matrix
    assert fused < probabilities // 2  # q, k, v, out, a logsumexp (and the mask's bias)
    with fused_attention():
        out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


def test_grouped_heads_and_real_tensors_pass_as_they_are() -> None:
    q, k, v = _qkv("meta", kv=KV)
    with fused_attention():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.sum().backward()
    assert out.shape == (B, H, L, D) and k.grad.shape == (B, KV, L, D)
    torch.manual_seed(0)
    q, k, v = (t.float() for t in _qkv("cpu"))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with fused_attention():
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(got, want)


class _Attend(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(x * 2, x, x, is_causal=True).sin()


class _Counting(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.calls += 1
        return func(*args, **(kwargs or {}))


class _Replayed(_Counting):
    replayed_in_recompute = True


def test_the_recompute_replays_only_the_modes_that_ask() -> None:
    """The autograd engine runs a recompute without the caller's torch function modes: the
    fused mode asks to be entered again (else the recompute runs the math and saves other
    tensors); a user's mode is not, so it sees the forward once, as without fxckpt."""
    q, _, _ = _qkv("meta")
    with fused_attention():
        out = fxckpt.checkpoint(_Attend(), q)
        out.sum().backward()  # the same tensors saved in the first run and the recompute
    x = torch.randn(B, H, L, D, requires_grad=True)
    for mode, runs in ((_Counting(), 1), (_Replayed(), 2)):
        with mode:
            fxckpt.checkpoint(_Attend(), x).sum().backward()
        assert mode.calls == runs


def test_the_seeding_tag_is_read_with_the_dropout() -> None:
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    q = torch.empty(1, 1, 4, 4, device="meta")
    assert no_dropout(flash, (q, q, q, 0.0, True), {})
    assert not no_dropout(flash, (q, q, q, 0.1, True), {})
    assert no_dropout(flash, (q, q, q), {})  # the default: no dropout
    assert not no_dropout(torch.ops.aten.native_dropout.default, (q, 0.0, True), {})


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                      use_cache=False, attn_implementation="sdpa")
    with torch.device("meta"):
        return LlamaForCausalLM(cfg).to(torch.bfloat16).train()


@pytest.mark.parametrize("profile", ["h100", None])
def test_a_meta_llama_is_planned_with_the_kernel_its_device_runs(profile) -> None:
    model, ids = _llama(), torch.zeros(2, 512, dtype=torch.long, device="meta")
    tm = fxckpt.transform(model, example_inputs=(ids,), device_profile=profile, budget=0.8)
    plan = dispatcher_of(tm).last.plan
    assert plan.verified_peak is not None and plan.verified_peak <= plan.budget_bytes
    tm = fxckpt.transform(model, example_inputs=(ids,), device_profile=profile, depth=3,
                          verify=True)
    plan = dispatcher_of(tm).last.plan
    assert plan.verified_peak is not None  # per layer: the recompute runs the same kernel
    kinds = {op for seg in plan.segments for op in (*seg.kept_ops, *seg.recomputed_ops)}
    assert kinds, "attention is in a segment"
    fused = "_scaled_dot_product_flash_attention" in kinds
    assert fused == (profile is not None), kinds
