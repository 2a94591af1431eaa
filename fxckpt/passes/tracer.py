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
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
import torch.fx
import torch.utils._pytree as pytree

__all__ = ["FxckptTracer", "function_call", "function_of", "has_hooks"]

_FUNCTION_CALLS: dict[type, Callable[..., Any]] = {}
_function_cls = torch.autograd.function.Function


def function_call(fn_cls: type) -> Callable[..., Any]:
    """The graph target that runs ``fn_cls.apply`` (one per Function class, named after it)."""
    call = _FUNCTION_CALLS.get(fn_cls)
    if call is None:
        def call(*args: Any, **kwargs: Any) -> Any:
            return fn_cls.apply(*args, **kwargs)  # type: ignore[attr-defined]

        call.__name__ = call.__qualname__ = f"{fn_cls.__name__}_apply"
        call.__module__ = fn_cls.__module__
        call.__dict__["fxckpt_function"] = fn_cls
        _FUNCTION_CALLS[fn_cls] = call
    return call


def function_of(target: Any) -> Optional[type]:
    """The autograd Function class a graph target calls, or ``None``."""
    return getattr(target, "fxckpt_function", None)


def has_hooks(module: torch.nn.Module) -> bool:
    """True when the module has forward, pre-forward or backward hooks of its own."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


class FxckptTracer(torch.fx.Tracer):
    """``torch.fx.Tracer`` with opaque autograd Functions, traced buffers and hooked leaves."""

    proxy_buffer_attributes = True

    def __init__(self, leaves: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.extra_leaves = leaves

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.extra_leaves:
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def trace(self, root: Any, concrete_args: Optional[dict[str, Any]] = None) -> torch.fx.Graph:
        with self._opaque_functions():
            return super().trace(root, concrete_args)

    @contextlib.contextmanager
    def _opaque_functions(self) -> Iterator[None]:
        original = _function_cls.__dict__["apply"]
        tracer = self

        def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
            leaves = pytree.tree_leaves((args, kwargs))
            if any(isinstance(a, torch.fx.Proxy) for a in leaves):
                return tracer.create_proxy("call_function", function_call(cls), args, kwargs)
            return original.__func__(cls, *args, **kwargs)

        _function_cls.apply = classmethod(apply)  # type: ignore[method-assign, assignment]
        try:
            yield
        finally:
            _function_cls.apply = original  # type: ignore[method-assign]
