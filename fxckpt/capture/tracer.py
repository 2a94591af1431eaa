"""The symbolic tracer fxckpt captures with: ``torch.fx.Tracer`` made faithful for training.

Three things the stock tracer gets silently wrong, each of which changes gradients or state:

* **Custom autograd Functions.** ``Fn.apply(x)`` on a Proxy runs ``Fn.forward`` and records its
  ops, so autograd of the forward replaces the Function's own backward (a straight-through
  estimator, Bloom's GELU). Here each call becomes one opaque node whose target calls
  ``Fn.apply`` for real, so the custom backward runs.
* **Buffers.** The stock tracer reads buffers as constants: ``self.step.add_(1)`` runs once at
  trace time and ``0.5 ** self.step`` is baked into the graph. Here buffers are ``get_attr``
  nodes, so in-place updates run every call (and are restored after a recompute).
* **Hooks.** A forward hook on a traced-through module fires once, on Proxies, while tracing.
  Modules with hooks are leaves here: the graph calls them, and their hooks fire on real
  tensors once per call.
* **Grad mode, autocast and random draws** (``with torch.no_grad():`` in forward,
  ``torch.randn(4, 16)``): recorded as nodes by :class:`~fxckpt.capture.regions.StateRecorder`
  instead of being lost or baked in.
"""

from __future__ import annotations

import contextlib
import threading
import types
from typing import Any, Callable, Iterator, Optional

import torch
import torch.fx
import torch.utils._pytree as pytree

from fxckpt.errors import CaptureError
from fxckpt.capture.isolation import on_thread
from fxckpt.capture.nn_modules import traced_forward
from fxckpt.capture.regions import StateRecorder
from fxckpt.runtime.segment import SEGMENT_FIELDS, SegmentModule

__all__ = ["FxckptTracer", "function_call", "function_of", "to_graph_module", "ORIGINAL_PATH"]

ORIGINAL_PATH = "fxckpt_path"
"""``node.meta`` key of a module or attribute path renamed because a GraphModule owns the name."""

# A lowered segment is a GraphModule too, with fields of its own (see fxckpt.runtime.segment).
_RESERVED = frozenset(set(dir(SegmentModule)) - set(dir(torch.nn.Module))) | {
    "meta", "shape_env", "graph", "code", "_code", "_graph", "_in_spec", "_out_spec", "_guards_fn",
    *SEGMENT_FIELDS,
}

_FUNCTION_CALLS: dict[type, Callable[..., Any]] = {}
_function_cls = torch.autograd.function.Function


def function_call(fn_cls: type) -> Callable[..., Any]:
    """The graph target that runs ``fn_cls.apply`` (one per Function class, named after it)."""
    call = _FUNCTION_CALLS.get(fn_cls)
    if call is None:
        def call(*args: Any, **kwargs: Any) -> Any:
            return fn_cls.apply(*args, **kwargs)  # type: ignore[attr-defined]

        call.__name__ = call.__qualname__ = f"{fn_cls.__name__}_apply"
        # Generated code names torch's own objects by their module path (which has no such
        # function: torch.utils.checkpoint's reentrant CheckpointFunction); others are globals.
        torchs = fn_cls.__module__.partition(".")[0] == "torch"
        call.__module__ = "fxckpt.functions" if torchs else fn_cls.__module__
        call.__dict__["fxckpt_function"] = fn_cls
        _FUNCTION_CALLS[fn_cls] = call
    return call


def function_of(target: Any) -> Optional[type]:
    """The autograd Function class a graph target calls, or ``None``."""
    return getattr(target, "fxckpt_function", None)


class FxckptTracer(torch.fx.Tracer):
    """``torch.fx.Tracer`` with opaque autograd Functions, traced buffers and hooked leaves."""

    proxy_buffer_attributes = True

    def __init__(self, leaves: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.extra_leaves = leaves

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.extra_leaves:
            return True
        if traced_forward(m) is not None:
            return False  # torch.nn's transformer modules: traced through (passes.nn_modules)
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: torch.nn.Module, forward: Callable[..., Any], args: tuple,
                    kwargs: dict) -> Any:
        traced = traced_forward(m)
        if traced is not None:
            forward = types.MethodType(traced, m)
        return super().call_module(m, forward, args, kwargs)

    def create_arg(self, a: Any) -> Any:
        # A model-owned generator (``torch.randn(..., generator=self.gen)``) becomes a constant
        # attribute of the graph, the same object, so the runtime can replay its draws. torch 2.13
        # does this by itself (an "opaque reference"); torch 2.11 refuses the argument.
        if isinstance(a, torch.Generator):
            name = self.tensor_attrs.get(a)  # type: ignore[call-overload]
            if name is None:
                name = self.get_fresh_qualname("_generator_")
                self.tensor_attrs[a] = name  # type: ignore[index]
                setattr(self.root, name, a)
            return self.create_node("get_attr", name, (), {})
        return super().create_arg(a)

    def trace(self, root: Any, concrete_args: Optional[dict[str, Any]] = None) -> torch.fx.Graph:
        state = _state_tensors(root) if isinstance(root, torch.nn.Module) else []
        with self._opaque_functions(), StateRecorder(self, state) as recorder:
            graph = super().trace(root, concrete_args)
        if recorder.drew:
            raise CaptureError(
                f"the forward draws random numbers while it is traced ({', '.join(recorder.drew)}"
                " on tensors no input reaches), which a traced graph would replay as constants"
            )
        if recorder.wrote:
            ops = ", ".join(dict.fromkeys(recorder.wrote))
            raise CaptureError(
                "the forward writes the model's parameters, buffers or tensor attributes in "
                f"place on tensors the tracer does not see ({ops}, e.g. through "
                "module.parameters() or a tensor kept as a plain attribute), which a traced "
                "graph would leave out"
            )
        return graph

    @contextlib.contextmanager
    def _opaque_functions(self) -> Iterator[None]:
        original = _function_cls.__dict__["apply"]
        tracer = self

        def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
            leaves = pytree.tree_leaves((args, kwargs))
            if any(isinstance(a, torch.fx.Proxy) for a in leaves):
                return tracer.create_proxy("call_function", function_call(cls), args, kwargs)
            return original.__func__(cls, *args, **kwargs)

        mine = on_thread(apply, original.__func__, threading.get_ident())
        _function_cls.apply = classmethod(mine)  # type: ignore[method-assign, assignment]
        try:
            yield
        finally:
            _function_cls.apply = original  # type: ignore[method-assign]


def _state_tensors(root: torch.nn.Module) -> list[torch.Tensor]:
    """The model's parameters, buffers and tensors kept as plain attributes."""
    plain = [v for m in root.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
    return [*root.parameters(), *root.buffers(), *plain]


def to_graph_module(
    root: torch.nn.Module, graph: torch.fx.Graph, class_name: str
) -> torch.fx.GraphModule:
    """``GraphModule(root, graph)``, renaming model attributes a GraphModule owns (``code``,
    ``graph``).

    A model may well have a child called ``graph`` (a GNN) or ``code``; as an attribute of the
    GraphModule it would clash with its own. Such targets get a ``_fxckpt`` suffix, and the
    original path is kept in ``node.meta[ORIGINAL_PATH]`` for module paths in plans.
    """
    targets: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op not in ("call_module", "get_attr"):
            continue
        original = str(node.target)
        head, dot, rest = original.partition(".")
        if head in _RESERVED:
            node.meta[ORIGINAL_PATH] = original
            node.target = f"{head}_fxckpt{dot}{rest}"
        targets[str(node.target)] = _resolve(root, original)
    return torch.fx.GraphModule(targets, graph, class_name)


def _resolve(root: torch.nn.Module, path: str) -> Any:
    value: Any = root
    for part in path.split("."):
        value = getattr(value, part)
    return value
