"""The benchmark's Llama-style model: what it is, and fxckpt's budget on it is exact."""

from __future__ import annotations

import copy

import pytest
import torch

import fxckpt
from benchmarks.methods import prepare
from benchmarks.models import MODELS, spec_for
from fxckpt.measure import step_peak_tracked

pytest.importorskip("transformers")


def test_llama_spec_is_a_rope_gqa_swiglu_decoder_with_sdpa_and_no_dropout() -> None:
    spec = spec_for("llama")
    model, (ids,), _ = spec.build(spec.quick)
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and spec.attention
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)  # grouped-query
    assert cfg._attn_implementation == "sdpa" and cfg.attention_dropout == 0.0
    assert cfg.hidden_act == "silu" and cfg.use_cache is False
    layers = model.get_submodule(spec.blocks)
    assert layers is model.model.layers and len(layers) == spec.quick["layers"]
    mlp = layers[0].mlp  # SwiGLU: down(silu(gate(x)) * up(x))
    assert (mlp.gate_proj.out_features, mlp.up_proj.out_features) == (176, 176)
    assert model.model.rotary_emb is not None  # RoPE
    assert ids.shape == (spec.quick["batch"], spec.quick["seq"])
    assert list(MODELS)[-1] == "llama" and spec.full["width"] == MODELS["gpt2"].full["width"]


def test_fxckpt_budget_on_llama_is_bit_exact_against_eager() -> None:
    spec = spec_for("llama")
    model, inputs, loss = spec.build(spec.quick)
    reference = copy.deepcopy(model)
    module, facts = prepare("fxckpt", model, inputs, spec, 0.5, time_solver=False)
    assert facts["segments"] > 0 and facts["recompute_flops_fraction"] > 0
    assert facts["verified_peak"] <= facts["budget_bytes"]
    for step in range(2):
        torch.manual_seed(step)
        loss(module(*inputs)).backward()
        torch.manual_seed(step)
        loss(reference(*inputs)).backward()
    pairs = list(zip(model.named_parameters(), reference.parameters()))
    assert len(pairs) == 2 + 9 * spec.quick["layers"] + 1  # embed, norm, head; 9 per layer
    for (name, p), q in pairs:
        assert torch.equal(p.grad, q.grad), name
    assert fxckpt.inspect(module).plan.capture == "export"


def test_the_bench_hands_fxckpt_the_step_s_loss() -> None:
    """With the step's loss handed over, the verified eager peak (what budget=0.5 is half of)
    and the plans count what that loss holds; the stand-in assumed without it holds at least as
    much (it also keeps the output through backward)."""
    spec = spec_for("llama")
    model, inputs, loss = spec.build(spec.quick)
    _, stand_in = prepare("fxckpt", copy.deepcopy(model), inputs, spec, 0.5, time_solver=False)
    module, facts = prepare("fxckpt", model, inputs, spec, 0.5, time_solver=False, loss=loss)
    assert facts["budget_bytes"] < stand_in["budget_bytes"]
    real = step_peak_tracked(lambda: loss(module(*inputs)).backward(), warmup=1, repeats=1)
    assert real["peak_bytes"] <= facts["budget_bytes"]
    assert abs(real["peak_bytes"] - facts["verified_peak"]) <= 0.01 * facts["verified_peak"]
