"""Every rule fxckpt follows for Hugging Face models (transformers, diffusers, PEFT), in one place.

* **Their own gradient checkpointing** (below): turned off, one checkpointing layer.
* **Training calls build no key/value cache** (:func:`without_cache`).
* **Hooks that are the model's own code** (:data:`TRANSPARENT_HOOKS`) are traced through.
* **Outputs**: a ``ModelOutput`` is recognised without importing transformers
  (:func:`is_model_output`), and an export names its class by a pattern that is checked before
  anything is imported (:data:`OUTPUT_TYPE`, :func:`output_class`).
* **A model from a ``config.json``** (the CLI's targets): :func:`model_from_config_file`.
* **Attention in exported graphs**: the pluggable ``attention_interface(...)`` call and the
  ``repeat_kv`` that feeds it (:func:`from_attention_interface`, :func:`repeated_kv`), which
  :mod:`fxckpt.capture.eager_attention` folds into one call.

This module imports nothing of transformers (a rule that needs it imports it when used) and
nothing of fxckpt but the :class:`~fxckpt.integrations.framework.Framework` protocol, which
:class:`HuggingFace` answers with these rules; :mod:`fxckpt.integrations` registers it, and the
runtime, the export loader and the passes all ask it there.

The model's own gradient checkpointing:

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

import dataclasses
import importlib
import inspect
import json
import logging
import operator
import re
import warnings
from typing import Any, Callable, Optional

import torch
import torch.fx

from fxckpt.integrations.framework import Framework

__all__ = [
    "release_own_checkpointing", "class_overrides", "checkpointing_layers", "takes_use_cache",
    "without_cache", "TRANSPARENT_HOOKS", "is_model_output", "OUTPUT_TYPE", "output_class",
    "from_attention_interface", "repeated_kv", "GQA_HEAD_LIMIT", "model_from_config_file",
    "HuggingFace",
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


def checkpointing_switches(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` with a ``gradient_checkpointing`` flag of their own (the
    layers a library's switch turns on): what :func:`own_checkpointing_on` looks at."""
    return [m for m in model.modules() if "gradient_checkpointing" in m.__dict__]


def own_checkpointing_on(switches: list[torch.nn.Module]) -> bool:
    """Whether any of ``switches`` has its own gradient checkpointing on (a few dict reads)."""
    return any(m.__dict__.get("gradient_checkpointing") is True for m in switches)


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


def without_cache(model: torch.nn.Module, kwargs: dict, announce: bool = False) -> Optional[dict]:
    """``kwargs`` with ``use_cache=False`` for a training call to a model whose forward takes it
    (:func:`takes_use_cache`, asked once by the caller) and whose ``config.use_cache`` is on
    (the default), as Hugging Face's own gradient checkpointing does: a key/value cache is for
    generation, and its cache object is not a graph output fxckpt can capture. ``None`` when
    the call is left as it is (the caller passed ``use_cache`` itself, or the config has it off).
    ``announce``: log at INFO that training calls run without the cache.
    """
    if "use_cache" in kwargs or not getattr(getattr(model, "config", None), "use_cache", False):
        return None
    if announce:
        log.info("%s: config.use_cache is on; training calls run with use_cache=False "
                 "(no key/value cache, as under Hugging Face's gradient checkpointing)",
                 type(model).__name__)
    return {**kwargs, "use_cache": False}


TRANSPARENT_HOOKS = ("transformers.utils.output_capturing",)
"""Modules whose hooks are part of the model's own forward (Hugging Face installs them to collect
router logits and hidden states): capture traces through them, like any other code of the model."""


def is_model_output(x: Any) -> bool:
    """A Hugging Face ``ModelOutput`` instance (an OrderedDict and a dataclass), without importing
    transformers."""
    return isinstance(x, dict) and dataclasses.is_dataclass(x)


OUTPUT_TYPE = re.compile(r"(transformers\.(?:modeling_outputs"
                         r"|models\.[a-z0-9_]+\.modeling_[a-z0-9_]+))\.[A-Za-z_][A-Za-z0-9_]*")
"""The serialized name of a transformers output class: the only pytree node type outside torch
and the builtins an export may name; its module is imported (which registers the outputs) only
when the name matches."""


def output_class(type_name: str, registered: dict[str, Any]) -> Optional[bool]:
    """For a pytree type name: ``None`` when it is not a transformers output's name; else whether
    the class it names, once its module is imported (``registered``: torch's table of serialized
    names, filled by the import), is a ``ModelOutput``."""
    match = OUTPUT_TYPE.fullmatch(type_name)
    if match is None:
        return None
    if type_name not in registered:
        importlib.import_module(match.group(1))  # transformers registers outputs on import
    cls = registered.get(type_name)
    from transformers.utils import ModelOutput

    return isinstance(cls, type) and issubclass(cls, ModelOutput)


def attention_causality(module: torch.nn.Module) -> Optional[bool]:
    """Whether every Hugging Face attention inside ``module`` is causal (``True``) or none is
    (``False``); ``None`` when it holds none, or both kinds. A layer called as it is receives
    ``attention_mask``, which eager code leaves ``None`` where it can skip it (see
    :func:`fxckpt.runtime.attention.layer_mask`)."""
    kinds = {getattr(m, "is_causal") for m in module.modules()
             if type(m).__module__.startswith("transformers.")
             and isinstance(getattr(m, "is_causal", None), bool)}
    return bool(kinds.pop()) if len(kinds) == 1 else None


GQA_HEAD_LIMIT = 256
"""Hugging Face's eager attention uses ``enable_gqa`` only for head sizes up to this."""

_INTERFACE = "attention_interface("
"""How Hugging Face's modeling code calls its pluggable attention (``sdpa_attention_forward``)."""


def from_attention_interface(node: torch.fx.Node) -> bool:
    """Traced from a Hugging Face module's ``attention_interface(...)`` call: the innermost
    module's class is transformers', and a line of the recorded stack is that call (the last
    line for export, which records the module's frame; one of the lines for Dynamo, which
    records every frame it inlined)."""
    from fxckpt.cost.node_info import model_stack

    stack = model_stack(node)
    if not stack:
        return False
    _, cls = stack[-1]
    name = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
    return name.startswith("transformers.") and _in_interface(node)


def _in_interface(node: torch.fx.Node) -> bool:
    return _INTERFACE in (node.meta.get("stack_trace") or "")


def repeated_kv(node: Any) -> Optional[tuple[torch.fx.Node, int]]:
    """``(x, n)`` for Hugging Face's ``repeat_kv`` traced inside the attention interface, each
    step used once; else ``None``. Export records it as
    ``reshape(expand(unsqueeze(x, 2), [b, h, n, s, d]), [b, h * n, s, d])``, Dynamo as
    ``x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)``."""
    if not (isinstance(node, torch.fx.Node) and _in_interface(node) and len(node.users) == 1):
        return None
    found = _exported_repeat(node) if node.op == "call_function" else _dynamo_repeat(node)
    if found is None:
        return None
    source, n = found
    return (source, n) if isinstance(source, torch.fx.Node) and _repeats(n) > 1 else None


def _repeats(n: Any) -> int:
    """How many times ``repeat_kv`` repeats: a constant, or a size Dynamo made symbolic (a model
    of the same class with other head counts compiled before: its value at this graph's call)."""
    if isinstance(n, torch.fx.Node):
        value = n.meta.get("example_value", n.meta.get("val"))
        hint = value.node.hint if isinstance(value, torch.SymInt) else None
        return int(hint) if hint is not None else 0
    return n if isinstance(n, int) else 0


def _exported_repeat(node: torch.fx.Node) -> Optional[tuple[Any, Any]]:
    aten = torch.ops.aten
    expand = node.args[0]
    if not (node.target is aten.reshape.default and isinstance(expand, torch.fx.Node)
            and expand.target is aten.expand.default and len(expand.users) == 1):
        return None
    sizes, shape = expand.args[1], node.args[1]
    if not (isinstance(sizes, (list, tuple)) and len(sizes) == 5
            and isinstance(shape, (list, tuple)) and len(shape) == 4):
        return None
    unsqueeze = expand.args[0]
    if not (isinstance(unsqueeze, torch.fx.Node) and unsqueeze.target is aten.unsqueeze.default
            and unsqueeze.args[1] == 2 and len(unsqueeze.users) == 1):
        return None
    return unsqueeze.args[0], sizes[2]


_NEW_AXIS = (slice(None), slice(None), None, slice(None), slice(None))
"""``[:, :, None, :, :]``: Dynamo's record of ``repeat_kv``'s new axis."""


def _dynamo_repeat(node: torch.fx.Node) -> Optional[tuple[Any, Any]]:
    expand = node.args[0] if node.args else None
    if not (node.op == "call_method" and node.target == "reshape"
            and isinstance(expand, torch.fx.Node) and expand.op == "call_method"
            and expand.target == "expand" and len(expand.users) == 1
            and len(_sizes(expand.args[1:])) == 5 and len(_sizes(node.args[1:])) == 4):
        return None
    index = expand.args[0]
    if not (isinstance(index, torch.fx.Node) and index.op == "call_function"
            and index.target is operator.getitem and len(index.users) == 1
            and index.args[1] == _NEW_AXIS):
        return None
    return index.args[0], _sizes(expand.args[1:])[2]


def _sizes(args: tuple) -> tuple:
    """A shape given to ``expand``/``reshape`` as one sequence or as separate arguments."""
    return tuple(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else args


def model_from_config_file(path: str, dtype: Optional[torch.dtype]) -> torch.nn.Module:
    """The model a Hugging Face ``config.json`` describes (its first ``architectures`` entry
    transformers has, else ``AutoModel``), with random weights, ``use_cache`` off (training), in
    ``dtype`` or the config's own. Raises ``ValueError`` saying what is wrong."""
    try:
        import transformers
    except ImportError as e:
        raise ValueError("a config.json target needs the transformers package") from e
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable JSON file: {e}") from e
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{path} is not a Hugging Face model config (it has no model_type)")
    fields = {k: v for k, v in data.items() if k != "model_type"}
    try:
        config = transformers.AutoConfig.for_model(data["model_type"], **fields)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    if hasattr(config, "use_cache"):
        config.use_cache = False  # training: no key/value cache
    archs = [a for a in (data.get("architectures") or []) if hasattr(transformers, a)]
    cls = getattr(transformers, archs[0]) if archs else transformers.AutoModel
    configured = getattr(config, "dtype", None) or data.get("torch_dtype")
    model_dtype = dtype or (getattr(torch, configured) if isinstance(configured, str)
                            else configured)
    kwargs = {"dtype": model_dtype} if isinstance(model_dtype, torch.dtype) else {}
    try:
        return cls._from_config(config, **kwargs) if hasattr(cls, "_from_config") \
            else cls.from_config(config, **kwargs)
    except Exception as e:
        raise ValueError(f"building {cls.__name__} from {path} failed: "
                          f"{type(e).__name__}: {e}") from e


class HuggingFace(Framework):
    """The rules above as fxckpt's :class:`~fxckpt.integrations.framework.Framework`."""

    name = "huggingface"
    transparent_hooks = TRANSPARENT_HOOKS
    gqa_head_limit: Optional[int] = GQA_HEAD_LIMIT

    def release_own_checkpointing(self, model: torch.nn.Module) -> list[str]:
        return release_own_checkpointing(model)

    def class_overrides(self, model_cls: type) -> dict[str, Callable[..., Any]]:
        return class_overrides(model_cls)

    def checkpointing_switches(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return checkpointing_switches(model)

    def own_checkpointing_on(self, switches: list[torch.nn.Module]) -> bool:
        return own_checkpointing_on(switches)

    def takes_use_cache(self, model: torch.nn.Module) -> bool:
        return takes_use_cache(model)

    def without_cache(self, model: torch.nn.Module, kwargs: dict,
                      announce: bool = False) -> Optional[dict]:
        return without_cache(model, kwargs, announce=announce)

    def is_output(self, x: Any) -> bool:
        return is_model_output(x)

    def names_output_type(self, type_name: str) -> bool:
        return OUTPUT_TYPE.fullmatch(type_name) is not None

    def output_class(self, type_name: str, registered: dict[str, Any]) -> Optional[bool]:
        return output_class(type_name, registered)

    def attention_causality(self, module: torch.nn.Module) -> Optional[bool]:
        return attention_causality(module)

    def from_attention_interface(self, node: torch.fx.Node) -> bool:
        return from_attention_interface(node)

    def repeated_kv(self, node: Any) -> Optional[tuple[torch.fx.Node, int]]:
        return repeated_kv(node)

    def model_from_config_file(self, path: str,
                               dtype: Optional[torch.dtype]) -> torch.nn.Module:
        return model_from_config_file(path, dtype)
