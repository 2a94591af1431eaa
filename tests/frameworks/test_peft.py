"""fxckpt with PEFT LoRA adapters, in either order: ``get_peft_model(fxckpt.transform(model))``
(adapters injected into the transformed model, which captures again when they appear) and
``fxckpt.transform(get_peft_model(model))`` (the PEFT wrapper captured whole).

The base weights are frozen, so no input of a checkpointed segment requires grad: with reentrant
checkpointing that silently gives no adapter gradients (transformers #26221, peft #137), which is
why Hugging Face calls ``enable_input_require_grads()``. fxckpt's recompute is non-reentrant and
needs no such switch. Every case is compared with the same PEFT model without fxckpt, same seed
before each forward (LoRA dropout draws random numbers): loss and every adapter gradient the same
bits, base weights without gradients.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch

import fxckpt
import tiny
from fxckpt.module import is_transformed

pytestmark = [
    pytest.mark.frameworks,
    # PEFT reads model.is_gradient_checkpointing, which transformers 5 renames (kept until v6)
    pytest.mark.filterwarnings("ignore:.*will be removed in v6:FutureWarning"),
]

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

SEQ = 16


_base = tiny.llama


def _lora(**more: Any) -> Any:
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           lora_dropout=0.1, task_type="CAUSAL_LM", **more)


def _peft(model: torch.nn.Module, **more: Any) -> Any:
    torch.manual_seed(5)  # the adapters' initial weights
    return peft.get_peft_model(model, _lora(**more))


def _adapters_then_transform(model: torch.nn.Module, strategy: dict, **more: Any) -> Any:
    return fxckpt.transform(_peft(model, **more), **strategy)


def _transform_then_adapters(model: torch.nn.Module, strategy: dict, **more: Any) -> Any:
    return _peft(fxckpt.transform(model, **strategy), **more)


ORDERS: dict[str, Callable[..., Any]] = {
    "get_peft_model(transform(model))": _transform_then_adapters,
    "transform(get_peft_model(model))": _adapters_then_transform,
}
STRATEGIES = {"every=1": {"every": 1}, "budget=0.5": {"budget": 0.5}}


def _transformed(m: torch.nn.Module) -> torch.nn.Module:
    """The module fxckpt returned, inside the PEFT wrapper or the wrapper itself."""
    return m if is_transformed(m) else m.base_model.model


def _pair(order: str, strategy: dict, **more: Any) -> tuple[Any, Any]:
    """(the PEFT model with fxckpt, the same PEFT model without it), equal weights."""
    base = _base()
    reference = _peft(copy.deepcopy(base), **more)
    m = ORDERS[order](base, strategy, **more)
    assert is_transformed(_transformed(m))
    got, expected = dict(m.named_parameters()), dict(reference.named_parameters())
    assert list(got) == list(expected)
    assert all(torch.equal(got[n], p) and got[n].requires_grad == p.requires_grad
               for n, p in expected.items())
    return m, reference


def _batch(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (4, SEQ), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _step(m: torch.nn.Module, batch: dict[str, torch.Tensor], seed: int) -> torch.Tensor:
    torch.manual_seed(seed)  # the LoRA dropout masks
    loss = m(**batch).loss
    loss.backward()
    return loss.detach()


def _assert_grads(m: torch.nn.Module, reference: torch.nn.Module, nonzero: bool = False) -> None:
    expected = dict(reference.named_parameters())
    trained = 0
    for name, p in m.named_parameters():
        if not p.requires_grad:
            assert "lora_" not in name
            assert p.grad is None and expected[name].grad is None, f"{name} has a gradient"
            continue
        trained += 1
        assert "lora_" in name and p.grad is not None, f"no gradient for {name}"
        assert torch.equal(p.grad, expected[name].grad), f"grad of {name} differs"
        assert not nonzero or p.grad.abs().sum() > 0, f"grad of {name} is zero"
    assert trained == 2 * 2 * 2  # (lora_A, lora_B) x (q_proj, v_proj) x 2 layers


def _assert_planned(m: torch.nn.Module) -> None:
    assert fxckpt.inspect(_transformed(m)).plan.segments, "fxckpt planned no segment"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("order", ORDERS)
def test_lora_gradients_equal_the_plain_peft_models(order: str, strategy: str) -> None:
    # init_lora_weights=False: lora_B is not zero, so the adapters (and their dropout) count
    m, reference = _pair(order, STRATEGIES[strategy], init_lora_weights=False)
    batch = _batch()
    loss = _step(m, batch, seed=7)
    assert torch.equal(loss, _step(reference, batch, seed=7))
    _assert_grads(m, reference)
    _assert_planned(m)
    with torch.no_grad():  # the dropout masks do draw from the seed: the comparison sees them
        torch.manual_seed(8)
        assert not torch.equal(reference(**batch).loss, loss)


@pytest.mark.parametrize("order", ORDERS)
def test_frozen_embeddings_still_give_every_adapter_a_gradient(order: str) -> None:
    """transformers #26221: with every decoder layer a segment (as Hugging Face checkpoints) and
    frozen embeddings, no segment input requires grad; the adapters must get their gradients
    anyway, non-zero (``init_lora_weights=False``: lora_B is not zero, so lora_A's grads are not)
    and equal to the plain model's."""
    depth = 3 if order.startswith("get_peft_model") else 5  # base_model.model.model.layers.N
    m, reference = _pair(order, {"depth": depth}, init_lora_weights=False)
    embeddings = m.get_input_embeddings()
    batch = _batch()
    assert not embeddings.weight.requires_grad
    assert not embeddings(batch["input_ids"]).requires_grad  # what the first layer receives
    assert torch.equal(_step(m, batch, seed=3), _step(reference, batch, seed=3))
    _assert_grads(m, reference, nonzero=True)
    paths = [s.module_paths for s in fxckpt.inspect(_transformed(m)).plan.segments]
    assert len(paths) == 2 and all(p[0].endswith(f"layers.{i}") for i, p in enumerate(paths))
    assert embeddings.weight.grad is None


@pytest.mark.parametrize("order", ORDERS)
def test_three_adamw_steps_train_the_adapters_like_the_plain_peft_model(order: str) -> None:
    m, reference = _pair(order, {"budget": 0.5})
    params: dict[str, dict[str, torch.Tensor]] = {}
    losses: dict[str, list[torch.Tensor]] = {}
    for what, model in (("fxckpt", m), ("plain", reference)):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses[what] = []
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            losses[what].append(_step(model, _batch(seed=step), seed=10 + step))
            opt.step()
        params[what] = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(torch.equal(a, b) for a, b in zip(losses["fxckpt"], losses["plain"], strict=True))
    assert params["fxckpt"].keys() == params["plain"].keys()
    different = [n for n, p in params["plain"].items() if not torch.equal(params["fxckpt"][n], p)]
    assert not different, f"parameters differ after 3 steps: {different}"
    base = _base()  # the adapters trained, the frozen weights did not
    frozen = {n.replace(".base_layer", ""): p for n, p in params["fxckpt"].items()
              if "lora_" not in n}
    assert all(torch.equal(p, frozen[f"base_model.model.{n}"]) for n, p in base.named_parameters())
    lora_b = [p for n, p in params["fxckpt"].items() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # zeros at the start
    _assert_planned(m)
    # one capture for the three steps: torch.export once swapped LoraModel.peft_config for an
    # equal copy, which failed its guard and captured again every step
    assert fxckpt.inspect(_transformed(m)).captures == 1
