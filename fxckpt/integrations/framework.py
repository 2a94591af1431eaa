"""The questions fxckpt asks a framework around a model (Hugging Face transformers, diffusers,
PEFT, ...): one :class:`Framework` per framework, registered in :mod:`fxckpt.integrations`,
which is the one place the rest of fxckpt asks them from.

A framework answers for its own models and conventions and says "not mine" otherwise (an empty
list or dict, ``False`` or ``None``), so several can be registered side by side. Answering must
not import the framework itself unless the question is about one of its objects: importing
fxckpt imports no framework.

This module imports nothing of fxckpt.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, runtime_checkable

import torch
import torch.fx

__all__ = ["Framework"]


@runtime_checkable
class Framework(Protocol):
    """Every rule fxckpt asks a framework for (see :mod:`fxckpt.integrations.hf` for one)."""

    name: str
    """Who this is, for messages and the registry (``"huggingface"``)."""

    transparent_hooks: tuple[str, ...]
    """Modules whose forward hooks are the model's own code (capture traces through them; they
    are not a user's hooks)."""

    gqa_head_limit: Optional[int]
    """The largest head size for which the framework's eager attention uses ``enable_gqa``
    (keys and values repeated by :meth:`repeated_kv` are then not repeated); ``None``: no rule."""

    # -- the model's own gradient checkpointing ------------------------------------------------

    def release_own_checkpointing(self, model: torch.nn.Module) -> list[str]:
        """Turn the model's own gradient checkpointing off (fxckpt checkpoints it); the layers it
        was on for (empty when none)."""
        ...

    def class_overrides(self, model_cls: type) -> dict[str, Callable[..., Any]]:
        """Methods of the transformed class that replace ``model_cls``'s switches turning its own
        gradient checkpointing on."""
        ...

    def checkpointing_switches(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The modules of ``model`` carrying a gradient-checkpointing switch of their own."""
        ...

    def own_checkpointing_on(self, switches: list[torch.nn.Module]) -> bool:
        """Whether any of ``switches`` has been switched on (a few dict reads: asked per call)."""
        ...

    # -- training calls -------------------------------------------------------------------------

    def takes_use_cache(self, model: torch.nn.Module) -> bool:
        """Whether ``model``'s forward takes a key/value-cache switch (asked once per model)."""
        ...

    def without_cache(self, model: torch.nn.Module, kwargs: dict,
                      announce: bool = False) -> Optional[dict]:
        """``kwargs`` as a training call runs them (no key/value cache), or ``None`` when the
        call is left as it is."""
        ...

    # -- outputs --------------------------------------------------------------------------------

    def is_output(self, x: Any) -> bool:
        """``x`` is one of the framework's output mappings (built again as
        ``type(x)(**fields)``)."""
        ...

    def names_output_type(self, type_name: str) -> bool:
        """``type_name`` (a serialized pytree node type) has the shape of one of the framework's
        output classes' names (checked before anything is imported)."""
        ...

    def output_class(self, type_name: str, registered: dict[str, Any]) -> Optional[bool]:
        """``None`` when ``type_name`` is not the framework's; else whether it names one of its
        output classes once its module is imported (``registered``: torch's serialized names)."""
        ...

    # -- attention in captured graphs ----------------------------------------------------------

    def attention_causality(self, module: torch.nn.Module) -> Optional[bool]:
        """Whether every attention of the framework's inside ``module`` is causal (``True``) or
        none is (``False``); ``None`` when it holds none, or both kinds."""
        ...

    def from_attention_interface(self, node: torch.fx.Node) -> bool:
        """``node`` was traced from the framework's pluggable attention call."""
        ...

    def repeated_kv(self, node: Any) -> Optional[tuple[torch.fx.Node, int]]:
        """``(x, n)`` when ``node`` is the framework's repetition of ``x``'s key/value heads
        ``n`` times, as export records it; else ``None``."""
        ...

    # -- models from files ----------------------------------------------------------------------

    def model_from_config_file(self, path: str,
                               dtype: Optional[torch.dtype]) -> torch.nn.Module:
        """The model a config file at ``path`` describes, with random weights; ``ValueError``
        saying what is wrong when the framework cannot build it."""
        ...
