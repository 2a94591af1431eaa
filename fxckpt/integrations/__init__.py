"""What fxckpt knows of the frameworks around a model (Hugging Face transformers, diffusers):
the one place the rest of fxckpt asks them from.

Each framework answers the questions of :class:`~fxckpt.integrations.framework.Framework`; the
frameworks registered here (:func:`register`; Hugging Face's, :mod:`fxckpt.integrations.hf`,
always) are asked in order through the functions below, which combine their answers. No module
outside this package imports a framework's rules directly (``tests/test_framework_rules.py``).
Registering Hugging Face's rules imports nothing of transformers: a rule that needs it imports it
when used.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.fx

from fxckpt.integrations.framework import Framework
from fxckpt.integrations.hf import HuggingFace

__all__ = [
    "Framework", "register", "unregister", "frameworks", "release_own_checkpointing",
    "class_overrides", "checkpointing_switches", "own_checkpointing_on", "takes_use_cache",
    "without_cache", "transparent_hooks", "is_output", "names_output_type", "output_class",
    "attention_causality", "from_attention_interface", "repeated_kv", "gqa_head_limit",
    "model_from_config_file",
]

_FRAMEWORKS: list[Framework] = [HuggingFace()]
_GQA_HEAD_LIMIT = [0]
"""The :func:`gqa_head_limit` of the registered frameworks, kept as they change (the runtime's
attention reads it on every call, under Dynamo too)."""


def _registered() -> None:
    _GQA_HEAD_LIMIT[0] = min(
        (f.gqa_head_limit for f in _FRAMEWORKS if f.gqa_head_limit is not None), default=0)


def register(framework: Framework) -> None:
    """Ask ``framework`` too, after those registered before it (once, however often passed)."""
    if not isinstance(framework, Framework):
        raise TypeError(f"{type(framework).__name__} does not answer fxckpt's Framework protocol")
    if framework not in _FRAMEWORKS:
        _FRAMEWORKS.append(framework)
        _registered()


def unregister(framework: Framework) -> None:
    """Stop asking ``framework`` (nothing when it is not registered)."""
    if framework in _FRAMEWORKS:
        _FRAMEWORKS.remove(framework)
        _registered()


def frameworks() -> tuple[Framework, ...]:
    """The registered frameworks, in the order they are asked."""
    return tuple(_FRAMEWORKS)


def release_own_checkpointing(model: torch.nn.Module) -> list[str]:
    """Turn every framework's own gradient checkpointing of ``model`` off; the layers it was on
    for."""
    return [layer for f in _FRAMEWORKS for layer in f.release_own_checkpointing(model)]


def class_overrides(model_cls: type) -> dict[str, Callable[..., Any]]:
    """The methods a transformed ``model_cls`` overrides (the earlier framework wins a name)."""
    found: dict[str, Callable[..., Any]] = {}
    for f in reversed(_FRAMEWORKS):
        found.update(f.class_overrides(model_cls))
    return found


def checkpointing_switches(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` with a gradient-checkpointing switch of their own (each once)."""
    seen: dict[int, torch.nn.Module] = {}
    for f in _FRAMEWORKS:
        for m in f.checkpointing_switches(model):
            seen.setdefault(id(m), m)
    return list(seen.values())


def own_checkpointing_on(switches: list[torch.nn.Module]) -> bool:
    """Whether any framework sees one of ``switches`` switched on."""
    return any(f.own_checkpointing_on(switches) for f in _FRAMEWORKS)


def takes_use_cache(model: torch.nn.Module) -> bool:
    """Whether some framework says ``model``'s forward takes a key/value-cache switch."""
    return any(f.takes_use_cache(model) for f in _FRAMEWORKS)


def without_cache(model: torch.nn.Module, kwargs: dict, announce: bool = False) -> Optional[dict]:
    """``kwargs`` as a training call runs them (the first framework that changes them), or
    ``None`` when the call is left as it is."""
    for f in _FRAMEWORKS:
        changed = f.without_cache(model, kwargs, announce=announce)
        if changed is not None:
            return changed
    return None


def transparent_hooks() -> tuple[str, ...]:
    """Modules whose hooks are a model's own code, not a user's."""
    return tuple(m for f in _FRAMEWORKS for m in f.transparent_hooks)


def is_output(x: Any) -> bool:
    """``x`` is a framework's output mapping (rebuilt as ``type(x)(**fields)``)."""
    return any(f.is_output(x) for f in _FRAMEWORKS)


def names_output_type(type_name: str) -> bool:
    """``type_name`` has the shape of a framework's output class name."""
    return any(f.names_output_type(type_name) for f in _FRAMEWORKS)


def output_class(type_name: str, registered: dict[str, Any]) -> Optional[bool]:
    """``None`` when no framework owns ``type_name``; else whether the first that does finds it
    names one of its output classes."""
    for f in _FRAMEWORKS:
        verdict = f.output_class(type_name, registered)
        if verdict is not None:
            return verdict
    return None


def attention_causality(module: torch.nn.Module) -> Optional[bool]:
    """The first framework's answer about its attention layers inside ``module``, if any."""
    for f in _FRAMEWORKS:
        causal = f.attention_causality(module)
        if causal is not None:
            return causal
    return None


def from_attention_interface(node: torch.fx.Node) -> bool:
    """``node`` was traced from a framework's pluggable attention call."""
    return any(f.from_attention_interface(node) for f in _FRAMEWORKS)


def repeated_kv(node: Any) -> Optional[tuple[torch.fx.Node, int]]:
    """``(x, n)`` when a framework recognises ``node`` as its key/value head repetition."""
    for f in _FRAMEWORKS:
        found = f.repeated_kv(node)
        if found is not None:
            return found
    return None


def gqa_head_limit() -> int:
    """The largest head size for which repeated keys and values run as ``enable_gqa`` (the
    smallest any framework sets; 0: none)."""
    return _GQA_HEAD_LIMIT[0]


def model_from_config_file(path: str, dtype: Optional[torch.dtype]) -> torch.nn.Module:
    """The model the config file at ``path`` describes, built by the first framework that can;
    else ``ValueError`` with the first framework's reason."""
    errors: list[ValueError] = []
    for f in _FRAMEWORKS:
        try:
            return f.model_from_config_file(path, dtype)
        except ValueError as e:
            errors.append(e)
    if errors:
        raise errors[0]
    raise ValueError(f"{path}: no framework registered with fxckpt builds a model from it")


_registered()
