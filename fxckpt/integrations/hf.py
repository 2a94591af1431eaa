"""The model's own gradient checkpointing (Hugging Face transformers and diffusers) under fxckpt.

Both libraries checkpoint a model's layers on request: ``model.gradient_checkpointing_enable()``
or ``activation_checkpointing_enable()`` (transformers, and ``TrainingArguments(
gradient_checkpointing=True)``, which calls them) and
``model.enable_gradient_checkpointing()`` (diffusers) set ``gradient_checkpointing = True`` on
each layer, which then runs through ``torch.utils.checkpoint``. Under fxckpt that would stack two
checkpointing layers: fxckpt's plan recomputes segments whose layers recompute themselves again,
and the plan's memory figures would describe neither. fxckpt wins, and says so once:

* a model transformed with its own checkpointing on has it turned off (the library's own
  ``gradient_checkpointing_disable()`` / ``disable_gradient_checkpointing()``);
* the transformed module's ``gradient_checkpointing_enable`` (and the other names of that
  switch) log that fxckpt already checkpoints the model and leave the layers as they are;
* a layer switched on behind fxckpt's back (through a wrapper's ``__getattr__``, or by setting
  the attribute) is switched off again when the model is next captured.

Layers are found by the convention both libraries share: a boolean ``gradient_checkpointing``
attribute on the module.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from typing import Any, Callable

import torch

__all__ = [
    "release_own_checkpointing", "class_overrides", "checkpointing_layers", "takes_use_cache",
]

log = logging.getLogger("fxckpt")

# transformers >= 5.x names first (its Trainer calls them), then the older ones, then diffusers'
_ENABLE = (
    "activation_checkpointing_enable", "gradient_checkpointing_enable",
    "enable_gradient_checkpointing",
)
_DISABLE = (
    "activation_checkpointing_disable", "gradient_checkpointing_disable",
    "disable_gradient_checkpointing",
)


def checkpointing_layers(model: torch.nn.Module) -> list[str]:
    """Names of the modules under ``model`` whose own gradient checkpointing is on."""
    return [
        name or "(root)"
        for name, m in model.named_modules()
        if m.__dict__.get("gradient_checkpointing") is True
    ]


def release_own_checkpointing(model: torch.nn.Module) -> list[str]:
    """Turn the model's own gradient checkpointing off, with a warning; the layers it was on for.
    """
    layers = checkpointing_layers(model)
    if not layers:
        return layers
    disable = next((getattr(model, n) for n in _DISABLE if hasattr(type(model), n)), None)
    if disable is not None:
        with warnings.catch_warnings():  # transformers 5 deprecates the older name
            warnings.simplefilter("ignore", FutureWarning)
            disable()
    for m in model.modules():  # whatever the library's own switch left on, or a model without one
        if m.__dict__.get("gradient_checkpointing") is True:
            m.__dict__["gradient_checkpointing"] = False
    log.warning(
        "fxckpt: %s had its own gradient checkpointing on (%d layers, e.g. %s); fxckpt turned it "
        "off, since fxckpt checkpoints the model itself and two checkpointing layers would "
        "recompute twice",
        type(model).__name__, len(layers), layers[0],
    )
    return layers


def class_overrides(model_cls: type) -> dict[str, Callable[..., Any]]:
    """Methods of the transformed class replacing the model class's own switches to turn its
    gradient checkpointing on: they log that fxckpt checkpoints the model and do nothing else."""
    return {name: _declined(name) for name in _ENABLE if callable(getattr(model_cls, name, None))}


def _declined(name: str) -> Callable[..., None]:
    def declined(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        log.warning(
            "fxckpt: %s.%s() ignored: fxckpt already checkpoints this model (its plan chooses "
            "what to recompute); the layers' own gradient checkpointing stays off",
            type(self).__name__, name,
        )

    declined.__name__ = declined.__qualname__ = name
    return declined


def takes_use_cache(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward takes ``use_cache`` (Hugging Face models), itself or, for a
    wrapper that passes ``**kwargs`` on (a PEFT model), its base model's forward."""
    params = _parameters(model.forward)
    if "use_cache" in params:
        return True
    passes_on = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    base = getattr(type(model), "get_base_model", None)
    if not (passes_on and callable(base)):
        return False
    inner = model.get_base_model()  # type: ignore[operator]
    return inner is not model and "use_cache" in _parameters(inner.forward)


def _parameters(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # no signature to read
        return {}
