"""The smallest plan is at or under per-block checkpointing, one of the plans fxckpt could choose.

A budget below every plan is refused with ``min_budget``, the smallest verified peak; per-block
checkpointing (each decoder layer under ``torch.utils.checkpoint``) must not reach lower. The
case that tests it: a Llama-style model with a squared loss, which holds five logits' worth at
once; a simulator that assumed two would choose a plan that keeps much until the loss and peaks
there (73.4 MiB against per-block's 62.3 MiB measured). So the loss is measured
(:mod:`fxckpt.measure.loss_probe`), and the per-block plan is verified beside the smallest one.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fxckpt
from benchmarks.methods import prepare
from benchmarks.models import MODELS, llama_config
from fxckpt.measure import step_peak_tracked
from fxckpt.cost.scratch import call_scratch

SIZES = {"vocab": 256, "width": 64, "ffn": 176, "layers": 2, "heads": 4, "kv_heads": 2,
         "seq": 64, "batch": 4}
"""Small, with a vocabulary four times the width as in the issue's model."""


def _llama() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config(SIZES)).train()


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=SIZES["layers"], n_embd=SIZES["width"], n_head=2,
                     n_positions=SIZES["seq"], vocab_size=SIZES["vocab"], bos_token_id=0,
                     eos_token_id=0, use_cache=False)
    return GPT2LMHeadModel(cfg).train()


MAKE = {"llama": _llama, "gpt2": _gpt2}


def _loss(out: object, *inputs: object) -> torch.Tensor:
    return out.logits.float().square().mean()  # type: ignore[attr-defined]


def _ids() -> tuple[torch.Tensor]:
    return (torch.randint(SIZES["vocab"], (SIZES["batch"], SIZES["seq"])),)


def _smallest(model: torch.nn.Module, ids: tuple) -> int:
    with pytest.raises(fxckpt.BudgetInfeasibleError) as e:
        fxckpt.transform(model, budget=1000, example_inputs=ids, loss_fn=_loss)
    return e.value.min_budget


def _per_block_measured(model: torch.nn.Module, name: str, ids: tuple) -> int:
    """Peak live tensor bytes of a step with each layer under ``torch.utils.checkpoint``."""
    module, _ = prepare("checkpoint_per_block", model, ids, MODELS[name], None)

    def step() -> None:
        _loss(module(*ids)).backward()

    return step_peak_tracked(step, warmup=1, repeats=1, scratch=call_scratch)["peak_bytes"]


@pytest.mark.parametrize("name", list(MAKE))
def test_the_smallest_plan_is_at_or_under_per_block(name: str) -> None:
    torch.manual_seed(0)
    model, ids = MAKE[name](), _ids()
    least = _smallest(copy.deepcopy(model), ids)
    assert least <= 1.02 * _per_block_measured(model, name, ids)


def test_per_block_is_verified_beside_the_smallest_simulated_plan(monkeypatch) -> None:
    """Where the simulator is wrong about the smallest plan (here: it offers none), the plan
    with one segment per layer, verified too, is the smallest that is refused with."""
    import fxckpt.planning.strategies as strategies

    monkeypatch.setattr(strategies, "min_peak_plan", lambda problem, blocks, starts=(): ((), 0))
    torch.manual_seed(0)
    model, ids = _llama(), _ids()
    least = _smallest(copy.deepcopy(model), ids)
    tm = fxckpt.transform(model, depth=3, example_inputs=ids, loss_fn=_loss, verify=True)
    per_block = fxckpt.inspect(tm).plan
    assert [seg.module_paths for seg in per_block.segments] == [("model.layers.0",),
                                                               ("model.layers.1",)]
    assert least == per_block.verified_peak
