"""Input signatures: when a captured graph or a plan can be reused, and how to call a graph.

A captured graph is specialised to everything Python saw while it was traced: the mode of every
module and which modules have hooks (those are called as they are), the autocast state, the
structure of the call (which arguments, nested in which lists and dicts), the values of its
non-tensor arguments (``None`` masks, ``return_dict=False``), and the dtypes, devices and ranks of
its tensors. That is the :class:`CallKey`. Shapes are not in it: a graph from ``symbolic_trace``,
or from ``torch.export`` with dynamic dimensions, serves every shape, and only a budget plan
depends on them (:func:`shapes_of`).

Non-tensor arguments are keyed by value. A value that cannot be keyed safely is refused rather
than guessed at: a mutable object (a config instance, a list held by the caller) could change
between two calls without the key changing, and the graph would silently run the old value.
Functions, classes and modules are keyed by identity, with the object held by the key so its
``id`` can never be reused by another object.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import types
from typing import Any, Callable, Hashable, Optional, Sequence

import torch
import torch.utils._pytree as pytree

from fxckpt.errors import InputError
from fxckpt import integrations
from fxckpt.runtime.state import autocast_state

__all__ = [
    "CallKey",
    "Binder",
    "call_key",
    "module_states",
    "has_hooks",
    "is_compiled",
    "shapes_of",
    "dominates",
    "describe_signature",
    "is_static_value",
    "value_key",
    "variant_key",
]

Shapes = tuple[tuple[int, ...], ...]

_VALUE_TYPES: tuple[type, ...] = (
    type(None), bool, int, float, complex, str, bytes, type(Ellipsis), range, slice,
    torch.dtype, torch.device, torch.layout, torch.memory_format, enum.Enum,
)
_IDENTITY_TYPES: tuple[type, ...] = (
    types.FunctionType, types.BuiltinFunctionType, types.MethodWrapperType, types.ModuleType, type,
)


@dataclasses.dataclass(frozen=True)
class CallKey:
    """Everything a captured graph is specialised to, except tensor shapes."""

    modules: tuple[tuple[bool, bool, bool], ...]
    """``(training, has hooks, compiled on its own)`` of the root and of every submodule, in
    ``modules()`` order: hooked and compiled submodules are called as they are by the graph."""
    autocast: tuple[Hashable, ...]
    """Autocast enabled/dtype for CPU and CUDA, and the default dtype (``torch.zeros(3)`` in
    forward is exported with it)."""
    spec: pytree.TreeSpec
    """The call's structure: ``(args, kwargs)`` as a pytree."""
    leaves: tuple[Hashable, ...]
    """Per leaf: a tensor's type, dtype, device, rank and ``requires_grad``, or a value's key."""


def module_states(root: torch.nn.Module) -> tuple[tuple[bool, bool, bool], ...]:
    """``(training, has hooks, compiled)`` of every module under ``root`` (see :class:`CallKey`);
    the root's own compilation (``tm.compile()``) is its caller's business, not the graph's."""
    return tuple(
        (m.training, has_hooks(m), i > 0 and is_compiled(m)) for i, m in enumerate(root.modules())
    )


def has_hooks(module: torch.nn.Module) -> bool:
    """True when the module has forward, pre-forward or backward hooks of the user's."""
    tables = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
              module._backward_pre_hooks)
    transparent = integrations.transparent_hooks()
    return any(getattr(h, "__module__", None) not in transparent
               for t in tables for h in t.values())


def is_compiled(module: torch.nn.Module) -> bool:
    """True for a module compiled on its own (``module.compile()``, or ``torch.compile(module)``).

    Such a module is called as it is (a leaf): tracing through it would drop its compilation.
    """
    from torch._dynamo.eval_frame import OptimizedModule

    return (
        isinstance(module, OptimizedModule)
        or module.__dict__.get("_compiled_call_impl") is not None
    )


def call_key(modules: tuple[tuple[bool, bool, bool], ...], args: tuple,
             kwargs: dict) -> tuple[CallKey, Shapes]:
    """The call's :class:`CallKey` and the shapes of its tensors (leaf order)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    keys: list[Hashable] = []
    shapes: list[tuple[int, ...]] = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            keys.append((type(leaf), leaf.dtype, leaf.device, leaf.dim(), leaf.requires_grad))
            shapes.append(tuple(leaf.shape))
        else:
            keys.append(value_key(leaf, lambda: _leaf_path(spec, i)))
    return CallKey(modules, _autocast_state(), spec, tuple(keys)), tuple(shapes)


def variant_key(training: bool, args: tuple, kwargs: dict) -> Hashable:
    """The root mode, call structure, tensor shapes/dtypes/devices and values: what a saved
    export's variants are matched by (see :mod:`fxckpt.export.loaded`)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return (
        training,
        str(spec),
        tuple(
            ("tensor", tuple(x.shape), x.dtype, x.device.type, x.device.index)
            if isinstance(x, torch.Tensor)
            else ("value", type(x).__qualname__, value_key(x))
            for x in leaves
        ),
    )


def value_key(value: Any, where: Callable[[], str] = lambda: "an argument") -> Hashable:
    """A key equal for equal values; :class:`~fxckpt.errors.InputError` for values that cannot be.
    """
    if isinstance(value, _VALUE_TYPES):
        return (type(value), _exact(value))
    if isinstance(value, torch.Size) or (
        type(value) is tuple and all(isinstance(v, _VALUE_TYPES) for v in value)
    ):
        return (type(value), tuple(map(_exact, value)))
    if isinstance(value, frozenset) and all(isinstance(v, _VALUE_TYPES) for v in value):
        return (frozenset, frozenset(map(_exact, value)))
    if isinstance(value, _IDENTITY_TYPES):
        return ("object", value)  # functions and classes compare by identity; the key holds them
    raise InputError(
        f"{where()} is a {type(value).__qualname__} object ({_short_repr(value)}); fxckpt "
        "specialises its graph to the values of non-tensor arguments and cannot tell when this "
        "object changes between calls. Pass plain values instead (None, bool, int, float, str, "
        "torch.dtype, or tuples and lists of them), or keep the object on the model as an "
        "attribute"
    )


def _exact(value: Any) -> Hashable:
    """A float or complex by its bits (``-0.0`` is not ``0.0``; a NaN equals a NaN), else itself.
    """
    if isinstance(value, float):
        return ("float", value.hex())
    if isinstance(value, complex):
        return ("complex", value.real.hex(), value.imag.hex())
    return value  # type: ignore[no-any-return]


def _autocast_state() -> tuple[Hashable, ...]:
    return (*autocast_state().flat(), torch.get_default_dtype())


def _leaf_path(spec: pytree.TreeSpec, index: int) -> str:
    """``argument 1`` or ``keyword argument 'config'`` for the leaf at ``index``."""
    args_spec, kwargs_spec = spec.children() if spec.num_children == 2 else (spec, None)
    n_args = args_spec.num_leaves
    if index < n_args:
        return f"positional argument {_top_index(args_spec, index)}"
    if kwargs_spec is not None:
        offset = index - n_args
        for name, child in zip(kwargs_spec.context, kwargs_spec.children()):
            if offset < child.num_leaves:
                return f"keyword argument {name!r}"
            offset -= child.num_leaves
    return f"argument leaf {index}"


def _top_index(args_spec: pytree.TreeSpec, index: int) -> int:
    for i, child in enumerate(args_spec.children()):
        if index < child.num_leaves:
            return i
        index -= child.num_leaves
    return index


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def shapes_of(args: tuple, kwargs: dict) -> Shapes:
    """The shapes of the call's tensors, in pytree leaf order."""
    return tuple(
        tuple(t.shape) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
    )


def dominates(big: Shapes, small: Shapes) -> bool:
    """True when every tensor of ``small`` fits in the matching tensor of ``big`` (same ranks)."""
    return len(big) == len(small) and all(
        len(b) == len(s) and all(x >= y for x, y in zip(b, s)) for b, s in zip(big, small)
    )


def describe_signature(args: tuple, kwargs: dict) -> str:
    """``(x: f32[8, 64], mask=None)`` for plans and log lines."""
    parts = [_describe(a) for a in args]
    parts += [f"{k}={_describe(v)}" for k, v in kwargs.items()]
    return "(" + ", ".join(parts) + ")"


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        dtype = str(x.dtype).replace("torch.", "")
        dev = "" if x.device.type == "cpu" else f" @{x.device}"
        return f"{dtype}{list(x.shape)}{dev}"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in x.items()) + "}"
    if isinstance(x, (list, tuple)):
        inner = ", ".join(_describe(v) for v in x)
        return f"[{inner}]" if isinstance(x, list) else f"({inner})"
    return repr(x)


class Binder:
    """Binds calls to a ``forward``'s parameters, as ``inspect.Signature.bind`` with defaults.

    Built once per captured graph: calls then run plain Python over a precomputed parameter
    table, which ``torch.compile`` traces without stepping into ``inspect``.
    """

    def __init__(self, fn: Callable) -> None:
        self.signature = inspect.signature(fn)
        params = list(self.signature.parameters.values())
        self.simple = all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                          for p in params)
        self.names = tuple(p.name for p in params)
        self.positional = tuple(p.name for p in params if p.kind != p.KEYWORD_ONLY)
        self.keyword_ok = frozenset(p.name for p in params if p.kind != p.POSITIONAL_ONLY)
        self.defaults = {p.name: p.default for p in params if p.default is not p.empty}
        self.var_keyword = next((p.name for p in params if p.kind == p.VAR_KEYWORD), None)

    def by_name(self, args: Sequence[Any], kwargs: dict) -> dict[str, Any]:
        """As :meth:`bind`, with the values caught by ``**kwargs`` under their own names, as
        ``torch.export`` names its inputs (a wrapper's ``forward(*args, **kwargs)``: PEFT's)."""
        bound = self.bind(args, kwargs)
        if self.var_keyword is not None:
            bound.update(bound.pop(self.var_keyword, {}))
        return bound

    def bind(self, args: Sequence[Any], kwargs: dict) -> dict[str, Any]:
        """Parameter name -> value for the call ``fn(*args, **kwargs)``, defaults filled in."""
        if not self.simple:
            bound = self.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return dict(bound.arguments)
        if len(args) > len(self.positional):
            raise TypeError(f"forward() takes {len(self.positional)} positional argument(s) but "
                            f"{len(args)} were given")
        values = dict(zip(self.positional, args))
        for name, value in kwargs.items():
            if name not in self.keyword_ok or name in values:
                why = "multiple values for" if name in values else "an unexpected keyword"
                raise TypeError(f"forward() got {why} argument {name!r}")
            values[name] = value
        out = {}
        for name in self.names:
            if name in values:
                out[name] = values[name]
            elif name in self.defaults:
                out[name] = self.defaults[name]
            else:
                raise TypeError(f"forward() missing a required argument: {name!r}")
        return out


def is_static_value(x: Any) -> bool:
    """True for an argument that holds no tensor (it can be baked into a traced graph)."""
    return not any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(x))


def first_tensor(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The first tensor of a call, if any."""
    return next(
        (t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None
    )
