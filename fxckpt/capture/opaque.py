"""Modules torch.export must not trace through, and swapping them back into its graph.

Export inlines custom ``torch.autograd.Function``s (their backward is lost) and bakes forward
hooks into the graph. The modules that call such Functions, and modules with hooks, are exported
with ``preserve_module_call_signature``; :func:`swapped` puts each back as a ``call_module``
node, so the real module runs: custom backward, hooks and all. :func:`recording` notes which
module made each Function call, :func:`function_callers` turns that into the modules to keep.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import dataclasses
import threading
import warnings
from typing import Any, Iterator

import torch
import torch.utils.checkpoint

from fxckpt.capture.isolation import on_thread
from fxckpt.errors import CaptureError

__all__ = ["swapped", "function_callers", "recording"]

_function_cls = torch.autograd.function.Function
_REENTRANT = torch.utils.checkpoint.CheckpointFunction
"""``checkpoint(..., use_reentrant=True)``: export would inline it and lose its backward."""


def swapped(model: torch.nn.Module, ep: torch.export.ExportedProgram, opaque: tuple[str, ...],
             calls: list[tuple[type, str]]) -> torch.fx.GraphModule:
    """``ep``'s module with the ``opaque`` modules swapped back in as ``call_module`` nodes."""
    from torch.export._swap import _swap_modules

    try:
        with warnings.catch_warnings():  # torch's swap adds its pytree specs right after warning
            warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")
            return _swap_modules(_builtin_inputs_named(ep),
                                 {p: model.get_submodule(p) for p in opaque})
    except Exception as e:
        functions = sorted({f"{cls.__qualname__} (in {path})" for cls, path in calls})
        raise CaptureError(
            f"fxckpt must call these modules of {type(model).__name__} as they are, but "
            f"torch.export could not swap them back into its graph: {', '.join(opaque)} "
            f"({type(e).__name__}: {str(e).strip().splitlines()[0][:200]}). They call custom "
            f"autograd Functions ({', '.join(functions) or 'none'}) or have hooks; traced "
            "through, a Function's backward would be replaced by autograd of its forward, and "
            "hooks would not fire. Fix: make the model traceable by torch.fx.symbolic_trace, "
            "which keeps Function calls and hooked modules opaque without swapping (torch.export "
            "fails to swap modules that create tensor constants)"
        ) from e


def _builtin_inputs_named(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``ep`` with its module call signatures naming inputs as ``ep.module()``'s graph does.

    torch's swap finds an opaque module's inputs by name in ``ep.module()``'s graph, but that
    graph renames a user input whose name is a Python builtin: ``nn.Sequential``'s ``input``
    becomes ``input_1``. A graph input passed straight to an opaque module (the first block of
    a ``Sequential`` with FSDP hooks) was then found nowhere and passed as ``None``.
    """
    names = list(ep.graph_signature.user_inputs)
    if not any(isinstance(n, str) and hasattr(builtins, n) for n in names):
        return ep
    placeholders = [n.name for n in ep.module().graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(names):
        return ep
    renamed = {old: new for old, new in zip(names, placeholders) if old != new}

    def rename(argument: Any) -> Any:
        name = getattr(argument, "name", None)
        if dataclasses.is_dataclass(argument) and name in renamed:
            return dataclasses.replace(argument, name=renamed[name])  # type: ignore[type-var]
        return argument

    entries = []
    for entry in ep.module_call_graph:
        signature = entry.signature
        if signature is not None and entry.fqn:
            signature = dataclasses.replace(signature,
                                            inputs=[rename(a) for a in signature.inputs])
        entries.append(dataclasses.replace(entry, signature=signature))
    fixed = copy.copy(ep)
    fixed._module_call_graph = entries
    return fixed


def function_callers(model: torch.nn.Module, calls: list[tuple[type, str]],
                      opaque: tuple[str, ...]) -> tuple[str, ...]:
    """The innermost modules of custom autograd Function calls that are not opaque yet."""
    at_root = sorted({cls.__qualname__ for cls, path in calls if path == ""})
    reentrant = sorted({path or "<root>" for cls, path in calls if cls is _REENTRANT})
    if reentrant:
        raise CaptureError(
            f"{type(model).__name__} calls torch.utils.checkpoint.checkpoint(..., "
            f"use_reentrant=True) (in {', '.join(reentrant)}), which torch.export cannot keep "
            "exact: it would inline the call and lose its backward. fxckpt chooses what to "
            "recompute itself: drop the call, pass use_reentrant=False (which export keeps "
            "exact), or capture with symbolic_trace (capture='graph' tries it first)"
        )
    if at_root:
        raise CaptureError(
            f"{type(model).__name__}.forward calls the custom autograd Function(s) "
            f"{', '.join(at_root)} directly, and torch.export replaces a Function's backward with "
            "autograd of its forward. fxckpt keeps such calls exact by calling the module that "
            "makes them as it is: move the call into a submodule (an nn.Module whose forward "
            "calls Fn.apply), or make the model traceable by torch.fx.symbolic_trace, which keeps "
            "Function calls opaque"
        )
    inside = [p for _, p in calls if not any(p == o or p.startswith(o + ".") for o in opaque)]
    return tuple(dict.fromkeys(inside))


@contextlib.contextmanager
def recording(model: torch.nn.Module) -> Iterator[list[tuple[type, str]]]:
    """Record ``(Function class, innermost module path)`` for each Function.apply call."""
    paths = {id(m): name for name, m in model.named_modules()}
    stack: list[str] = []
    calls: list[tuple[type, str]] = []
    original = _function_cls.__dict__["apply"]

    def pre(module: torch.nn.Module, _args: Any) -> None:
        stack.append(paths.get(id(module), stack[-1] if stack else ""))

    def post(module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if stack:
            stack.pop()

    def apply(cls: type, *a: Any, **k: Any) -> Any:
        if cls.__module__.split(".")[0] != "torch" or cls is _REENTRANT:
            calls.append((cls, stack[-1] if stack else ""))
        return original.__func__(cls, *a, **k)

    def nothing(*_: Any) -> None:
        return None

    thread = threading.get_ident()  # global hooks fire for every thread's modules: note ours
    handles = [
        torch.nn.modules.module.register_module_forward_pre_hook(on_thread(pre, nothing, thread)),
        torch.nn.modules.module.register_module_forward_hook(on_thread(post, nothing, thread),
                                                             always_call=True)]
    mine = on_thread(apply, original.__func__, thread)
    _function_cls.apply = classmethod(mine)  # type: ignore[method-assign, assignment]
    try:
        yield calls
    finally:
        _function_cls.apply = original  # type: ignore[method-assign]
        for h in handles:
            h.remove()
