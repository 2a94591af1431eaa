"""What fxckpt does about the frameworks around a model (fxckpt/integrations/hf.py, module.py):
the transformed forward looks like the model's, a model's own gradient checkpointing is turned
off (never stacked under fxckpt's), and PEFT's pass-through wrappers capture and plan."""

from __future__ import annotations

import copy
import functools
import inspect
import logging
from typing import Callable

import pytest
import torch

import fxckpt
from fxckpt.integrations import hf

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128,
    )
    return transformers.LlamaForCausalLM(config)


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def _grads(model: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor | None]:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(0)
    model(input_ids=x, labels=x).loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _assert_same(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name, g in expected.items():
        assert (got[name] is None) == (g is None), name
        assert g is None or torch.equal(got[name], g), f"grad of {name} differs"


class Typed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 2.0, *, mask: bool = False) -> torch.Tensor:
        """Scale a linear map."""
        return self.lin(x) * scale


def _sequential() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("build", [_llama, Typed, _sequential])
def test_forward_has_the_models_signature_doc_and_wrapped(build: Callable[[], torch.nn.Module]
                                                          ) -> None:
    model = build()
    tm = fxckpt.transform(model, every=1)
    assert inspect.signature(tm.forward) == inspect.signature(model.forward)
    assert tm.forward.__doc__ == model.forward.__doc__
    assert tm.forward.__wrapped__ is type(model).forward
    assert tm.forward.__name__ == "forward"


def test_signature_change_keeps_the_rewritten_forward_running() -> None:
    model = Typed()
    tm = fxckpt.transform(copy.deepcopy(model), every=1)
    x = torch.randn(3, 4)
    tm(x, 3.0).sum().backward()
    model(x, 3.0).sum().backward()
    assert torch.equal(tm.lin.weight.grad, model.lin.weight.grad)
    assert fxckpt.inspect(tm).plan.segments, "the rewritten graph ran, not the model's forward"


def test_own_checkpointing_is_turned_off_at_transform(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[bool] = []  # per torch checkpoint call: was it a Hugging Face layer's?
    real = torch.utils.checkpoint.checkpoint

    def spy(fn: object, *args: object, **kwargs: object) -> object:
        calls.append(isinstance(fn, functools.partial))  # the layers pass partial(forward)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", spy)
    monkeypatch.setattr(transformers.modeling_utils, "checkpoint", spy)  # imported by name there
    torch.manual_seed(0)
    model = _llama()
    x = _ids()
    expected = _grads(copy.deepcopy(model), x)
    control = copy.deepcopy(model)
    control.gradient_checkpointing_enable()
    _assert_same(_grads(control, x), expected)
    assert sum(calls) == 2, "the spy sees the layers' own checkpointing"
    calls.clear()
    model.gradient_checkpointing_enable()
    assert hf.checkpointing_layers(model)
    with caplog.at_level(logging.WARNING, logger="fxckpt"):
        tm = fxckpt.transform(model, every=1)
    assert not hf.checkpointing_layers(model)
    assert "had its own gradient checkpointing on (3 layers" in caplog.text
    _assert_same(_grads(tm, x), expected)
    assert calls and not any(calls), "fxckpt's segments checkpoint; no layer checkpoints itself"


def test_enabling_own_checkpointing_on_the_transformed_model_is_declined(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tm = fxckpt.transform(_llama(), every=1)
    with caplog.at_level(logging.WARNING, logger="fxckpt"):
        tm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert "LlamaForCausalLM.gradient_checkpointing_enable() ignored" in caplog.text
    tm.activation_checkpointing_enable()
    assert "activation_checkpointing_enable() ignored" in caplog.text
    assert not hf.checkpointing_layers(tm)
    tm.activation_checkpointing_disable()  # still the model's own, harmless


def test_checkpointing_switched_on_behind_fxckpts_back_is_turned_off_at_the_next_capture(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(_llama(), lora)
    x = _ids()
    expected = _grads(copy.deepcopy(model), x)
    tm = fxckpt.transform(model, every=1)
    _assert_same(_grads(tm, x), expected)
    # PeftModel has no gradient_checkpointing_enable of its own: its __getattr__ reaches the
    # base model's, which switches the layers on (and hooks the embeddings, for reentrancy)
    tm.gradient_checkpointing_enable()
    assert hf.checkpointing_layers(tm)
    with caplog.at_level(logging.WARNING, logger="fxckpt"):
        got = _grads(tm, x)
    assert "fxckpt turned it off" in caplog.text
    assert not hf.checkpointing_layers(tm)
    _assert_same(got, expected)


def test_a_pass_through_wrapper_with_a_hooked_module_captures_by_name() -> None:
    """PeftModel.forward is ``(*args, **kwargs)``; with a hook the capture keeps the hooked
    module whole, and its graph's inputs are named as the call's keywords."""
    torch.manual_seed(0)
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    embed = model.get_base_model().model.embed_tokens
    embed.register_forward_hook(lambda m, i, out: out.requires_grad_(True))
    x = _ids()
    expected = _grads(copy.deepcopy(model), x)
    tm = fxckpt.transform(model, every=1)
    _assert_same(_grads(tm, x), expected)
    assert len(fxckpt.inspect(tm).plan.segments) > 1


def test_use_cache_is_seen_through_a_pass_through_wrapper() -> None:
    base = _llama()
    assert hf.takes_use_cache(base)
    wrapped = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    assert "use_cache" not in inspect.signature(wrapped.forward).parameters
    assert hf.takes_use_cache(wrapped)
    assert not hf.takes_use_cache(Typed())


@pytest.mark.parametrize("padded", [False, True], ids=["no_padding", "padding"])
def test_a_layer_called_as_it_is_gets_the_mask_eager_code_gives_it(padded: bool) -> None:
    """A decoder layer with a forward hook is called as it is under capture='export' (as an
    FSDP-sharded one is). Eager Hugging Face code gives it attention_mask=None when nothing is
    padded (its attention then runs is_causal=True); the exported graph built a boolean mask, so
    the graph passes it through fxckpt_layer_mask, and the layer sees what eager code passes."""
    seen: list[object] = []
    model = _llama()
    model.model.layers[0].register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs.get("attention_mask")), with_kwargs=True)
    reference = copy.deepcopy(model)
    x = _ids()
    mask = torch.ones_like(x)
    if padded:
        mask[0, :3] = 0
    tm = fxckpt.transform(model, every=1, capture="export", example_inputs=(),
                          example_kwargs={"input_ids": x, "attention_mask": mask, "labels": x})
    from fxckpt.module import dispatcher_of

    compiled = dispatcher_of(tm).last
    assert compiled is not None and "fxckpt_layer_mask(" in compiled.captured.gm.code
    for module in (tm, reference):
        for p in module.parameters():
            p.grad = None
        seen.clear()
        torch.manual_seed(0)
        module(input_ids=x, attention_mask=mask, labels=x).loss.backward()
        if padded:  # a padded batch keeps its mask, in eager code and in the graph
            assert all(isinstance(m, torch.Tensor) for m in seen), seen
        else:
            assert seen and all(m is None for m in seen), seen
    _assert_same({n: p.grad for n, p in model.named_parameters()},
                 {n: p.grad for n, p in reference.named_parameters()})
