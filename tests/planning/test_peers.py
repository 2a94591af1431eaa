"""planning/peers.py: the hand-written plans on a real graph, and the budget search against them.

A Hugging Face Llama (eager attention: its matmuls and softmax are nodes of their own) planned
on the meta device, priced by the CPU table and by the ``h100`` profile: at the predicted peak of
each hand policy written with fxckpt's own options (``depth=`` one segment per layer, ``force=``
pinning what the policy keeps), ``budget=`` recomputes no more than the policy, by the same
prices. A small GPT-2 on real tensors checks that a plan fitted from a start trains exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fxckpt
from fxckpt.module import dispatcher_of
from fxckpt.planning import strategies

POLICIES = {
    "per-block": {},
    "op policy": {"op:aten.mm": "save", "op:aten.bmm": "save"},
    "Megatron selective": {"op:aten.mm": "save"},
}


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, vocab_size=8000,
                      use_cache=False, attn_implementation="eager")
    with torch.device("meta"):
        return LlamaForCausalLM(cfg).to(torch.bfloat16).train()


@pytest.fixture(scope="module")
def llama() -> tuple[torch.nn.Module, torch.Tensor]:
    return _llama(), torch.zeros(2, 1024, dtype=torch.long, device="meta")


def _plan(model: torch.nn.Module, x: torch.Tensor, profile: str, **options) -> fxckpt.Plan:
    tm = fxckpt.transform(model, example_inputs=(x,), device_profile=profile, verify=False,
                          **options)
    return dispatcher_of(tm).last.plan


def test_the_starts_are_the_policies_on_this_graph(llama, monkeypatch) -> None:
    model, x = llama
    seen = {}
    real = strategies.peer_starts

    def spy(problem, order, blocks, groups):
        starts = real(problem, order, blocks, groups)
        seen.update(problem=problem, blocks=blocks, starts={s.name: s for s in starts})
        return starts

    monkeypatch.setattr(strategies, "peer_starts", spy)
    _plan(model, x, "cpu", budget=0.5)
    problem, blocks, starts = seen["problem"], seen["blocks"], seen["starts"]
    assert set(starts) == {"per-block", "op policy", "op policy (every other mm)",
                           "Megatron selective", "sequential"}
    assert len(blocks) == 4 and starts["per-block"].segments == tuple(blocks)
    assert starts["sequential"].segments == ((blocks[0][0], blocks[1][1]),)  # the last run: no
    names = {k: {problem.ops[g[-1]].name for g in s.keep} for k, s in starts.items()}
    # per layer: seven linear layers (q, k, v, o, gate, up, down) and two attention matmuls
    assert len(names["Megatron selective"]) == 4 * 7
    assert all(n.startswith("linear") for n in names["Megatron selective"])
    assert len(names["op policy"]) == 4 * 9
    assert names["Megatron selective"] < names["op policy"]
    assert names["op policy (every other mm)"] < names["op policy"]
    assert len(names["op policy (every other mm)"]) == 4 * 2 + 14
    assert names["per-block"] == names["sequential"] == set()


@pytest.mark.parametrize("profile", ["cpu", "h100"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_at_each_policys_peak_the_budget_plan_recomputes_no_more(llama, profile: str,
                                                                 policy: str) -> None:
    model, x = llama
    hand = _plan(model, x, profile, depth=3, force=POLICIES[policy])
    assert len(hand.segments) == 4
    ours = _plan(model, x, profile, budget=hand.predicted_peak)
    assert ours.predicted_peak <= hand.predicted_peak
    assert ours.predicted_recompute <= hand.predicted_recompute


def test_a_start_is_named_where_it_wins_and_the_plan_trains_exactly() -> None:
    """A 2-layer GPT-2 at 0.6 of its peak: the per-block start is the cheapest plan; the step's
    gradients equal the unmodified model's bit for bit (dropout on)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=128,
                     bos_token_id=0, eos_token_id=0, use_cache=False)
    model, x = GPT2LMHeadModel(cfg).train(), torch.randint(128, (4, 64))
    eager = copy.deepcopy(model)
    tm = fxckpt.transform(model, budget=0.6, example_inputs=(x,))
    plan = fxckpt.inspect(tm).plan
    assert any("fitted from the per-block plan" in n for n in plan.notes), plan.notes
    assert plan.verified_peak is not None and plan.verified_peak <= plan.budget_bytes
    torch.manual_seed(1)  # dropout draws the same masks in both steps
    tm(x).logits.float().square().mean().backward()
    torch.manual_seed(1)
    eager(x).logits.float().square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad), name
