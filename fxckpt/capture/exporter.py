"""Capture with ``torch.export`` (non-strict training IR): dynamic shapes and opaque modules.

``symbolic_trace`` cannot follow data-dependent Python or most Hugging Face models; export can.
Two additions make its graph fit fxckpt:

* **Dynamic shapes.** Tensor dimensions are exported as ``Dim.AUTO`` (for images, only the batch),
  so export keeps the batch and sequence dimensions symbolic where the model allows and
  specialises the rest. One
  capture then serves every batch size and sequence length (dynamic padding costs no capture).
  :class:`ShapeRule` records which dimensions stayed fixed and the range of the others, so a
  call outside them captures again instead of failing a guard. If export refuses dynamic
  shapes, the graph is exported for the example's shapes.
* **Opaque modules.** Export inlines custom ``torch.autograd.Function``s (their backward is lost)
  and bakes forward hooks into the graph. The modules that call such Functions, and modules
  with hooks, are exported with ``preserve_module_call_signature`` and swapped back in as
  ``call_module`` nodes (:mod:`fxckpt.capture.opaque`), so the real module runs.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import dis
import logging
import os
import sys
from typing import Any, Optional, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch.overrides import TorchFunctionMode

from fxckpt.errors import CaptureError, grad_mode_left
from fxckpt.capture.opaque import function_callers, recording, swapped
from fxckpt.capture.simplify import simplify
from fxckpt.signature import Binder, Shapes
from fxckpt.runtime.state import autocast_state

__all__ = ["ShapeRule", "Exported", "export_graph"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ShapeRule:
    """Which tensor shapes an exported graph accepts: fixed sizes, or a range per dimension."""

    dims: tuple[tuple[tuple[int, Optional[int]], ...], ...]
    """Per tensor input, per dimension, ``(low, high)``; ``high`` ``None`` means unbounded."""

    def accepts(self, shapes: Shapes) -> bool:
        if len(shapes) != len(self.dims):
            return False
        for shape, dims in zip(shapes, self.dims):
            if len(shape) != len(dims):
                return False
            for size, (low, high) in zip(shape, dims):
                if size < low or (high is not None and size > high):
                    return False
        return True

    @property
    def dynamic(self) -> bool:
        return any(low != high for dims in self.dims for low, high in dims)


@dataclasses.dataclass
class Exported:
    gm: torch.fx.GraphModule
    shapes: ShapeRule
    opaque: tuple[str, ...]
    """Module paths called as they are (``call_module`` nodes), not traced through."""


def export_graph(
    model: torch.nn.Module, args: tuple, kwargs: dict, opaque: Sequence[str]
) -> Exported:
    """Export ``model`` for calls like these, dynamic where possible, ``opaque`` modules kept."""
    opaque = tuple(opaque)
    with recording(model) as calls, _GradUnderAutocast() as nested:
        ep = _export_program(model, args, kwargs, opaque)
    if nested.left is not None:
        raise CaptureError(grad_mode_left(f"{type(model).__name__}.forward", bool(nested.left)))
    if nested.seen:
        raise CaptureError(
            f"{type(model).__name__}.forward changes grad mode inside a torch.autocast block "
            f"({nested.seen[0]}), and torch.export's graph loses such a grad-mode region (a "
            "limitation of torch.export: the block would compute gradients). Capture with "
            "symbolic_trace (capture='graph' tries it first), or put the no_grad block around "
            "the autocast block instead of inside it"
        )
    if nested.tensor_hooks:
        raise CaptureError(
            f"{type(model).__name__}.forward registers a hook on a tensor it computes "
            "(tensor.register_hook), and torch.export's graph drops it: its gradient would skip "
            "the hook. Train with capture='auto' (the default: Dynamo keeps the hook, and fxckpt "
            "never recomputes it), or register the hook on a module (register_full_backward_hook)"
        )
    callers = function_callers(model, calls, opaque)
    if callers:  # export again, calling those modules as they are
        log.info(
            "keeping modules that call custom autograd Functions opaque: %s", ", ".join(callers)
        )
        opaque = opaque + callers
        ep = _export_program(model, args, kwargs, opaque)
    rule = _shape_rule(ep)
    gm = swapped(model, ep, opaque, calls) if opaque else ep.module()
    _mend_guards(gm)
    done = simplify(gm)
    log.debug("simplified the exported graph: %s", done)
    return Exported(gm, rule, opaque)


def _mend_guards(gm: torch.fx.GraphModule) -> None:
    """Silence export's input guards where torch wrote code that cannot run.

    torch 2.11 writes a float argument's guard with a bare ``nan`` or ``inf`` name
    (``args[1] == nan``), which raises ``NameError`` at every call, even the one exported for.
    Such a guard function is replaced by a no-op: fxckpt's own call key already matches constant
    arguments by their bits, and its shape rule the dimensions. torch 2.13 writes them soundly.
    """
    guards = getattr(gm, "_guards_fn", None)
    code = _generated(getattr(guards, "forward", None))
    if code is None:
        return
    known = set(code.__globals__) | set(vars(builtins))
    read = {i.argval for i in dis.get_instructions(code)
            if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    missing = sorted(read - known)
    if missing:
        log.info("torch.export's input guards read undefined names %s; fxckpt's call key checks "
                 "those arguments instead", missing)
        guards.forward = _no_guards  # type: ignore[union-attr]


def _no_guards(*_: Any) -> None:
    return None


def _generated(fn: Any, depth: int = 0) -> Any:
    """The function torch.export generated for its guards (named ``_``), under its wrappers."""
    if getattr(fn, "__code__", None) is not None and fn.__code__.co_name == "_":
        return fn
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if callable(value) and depth < 4:
            found = _generated(value, depth + 1)
            if found is not None:
                return found
    return None


class _GradUnderAutocast(TorchFunctionMode):
    """Notes the grad-mode changes the model's own code makes while it is exported: those inside
    an autocast block it entered (:attr:`seen`), and whether it leaves the mode changed
    (:attr:`left`: the mode it left, or ``None``); and the hooks it registers on tensors
    (:attr:`tensor_hooks`), which the exported graph drops. torch.export restores the mode
    itself, so only the model's calls count: those whose first caller outside torch is not
    fxckpt."""

    def __enter__(self) -> "_GradUnderAutocast":
        self.seen: list[str] = []
        self.autocast = autocast_state().devices
        self.grad = torch.is_grad_enabled()
        self.last: Optional[bool] = None
        self.tensor_hooks = 0
        return super().__enter__()  # type: ignore[no-any-return]

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        if func is torch._C._set_grad_enabled and _called_by_model():
            self.last = bool(args[0])
            if autocast_state().devices != self.autocast:
                self.seen.append(f"torch.set_grad_enabled({args[0]}) under autocast")
        elif func is torch.Tensor.register_hook and _called_by_model():
            self.tensor_hooks += 1  # registered on a traced tensor: the graph has no trace of it
        return func(*args, **(kwargs or {}))

    @property
    def left(self) -> Optional[bool]:
        return self.last if self.last is not None and self.last != self.grad else None


_TORCH_DIR = os.path.dirname(torch.__file__)
_STDLIB_DIR = os.path.dirname(contextlib.__file__)
_FXCKPT_DIR = os.path.dirname(os.path.dirname(__file__))


def _library(path: str) -> bool:
    """torch's code or Python's standard library (skipped to find whose code made a call)."""
    return path.startswith(_TORCH_DIR) or (
        path.startswith(_STDLIB_DIR) and "site-packages" not in path)


def _called_by_model() -> bool:
    frame = sys._getframe(2)
    while frame is not None and _library(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
    return frame is not None and not frame.f_code.co_filename.startswith(_FXCKPT_DIR)


def _export_program(model: torch.nn.Module, args: tuple, kwargs: dict,
                    opaque: tuple[str, ...]) -> torch.export.ExportedProgram:
    """Export with every dimension dynamic where the model allows; for these shapes if it refuses.

    A model on the meta device is exported for these shapes only: it is planned, never trained
    (``to_empty()`` replaces its tensors, and the capture with them), and symbolic sizes cost a
    third of the capture (a 70B Llama: 28 s against 17 s on this machine).
    """
    if _on_meta(model, args, kwargs):
        return _export(model, args, kwargs, opaque)
    return _export_dynamic(model, args, kwargs, opaque)


def _on_meta(model: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    first = next(iter(model.parameters()), None)
    return bool(tensors) and all(t.is_meta for t in tensors) and (first is None or first.is_meta)


def _export(model: torch.nn.Module, args: tuple, kwargs: dict, opaque: tuple[str, ...],
            shapes: Optional[dict[str, Any]] = None) -> torch.export.ExportedProgram:
    """``torch.export``: with these dynamic dimensions, or for these shapes only."""
    return torch.export.export(model, tuple(args), dict(kwargs), strict=False,
                               dynamic_shapes=shapes, preserve_module_call_signature=opaque)


def _export_dynamic(model: torch.nn.Module, args: tuple, kwargs: dict,
                    opaque: tuple[str, ...]) -> torch.export.ExportedProgram:
    try:
        return _export(model, args, kwargs, opaque, _dynamic_shapes(model, args, kwargs))
    except Exception as e:  # export refused symbolic sizes somewhere: specialise to these shapes
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        log.info(
            "torch.export with dynamic shapes failed (%s); exporting for these shapes only", first
        )
        return _export(model, args, kwargs, opaque)


def _dynamic_shapes(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``{parameter name: {dim: Dim.AUTO}}`` for the call's tensors, ``None`` elsewhere.

    Every dimension is dynamic, except the spatial ones of images (rank >= 4: batch, channels,
    height, width, ...): training crops to one size, and symbolic image sizes make export slow
    (Swin: 98 s against 2.5 s with only the batch dynamic). A new image size captures again.
    """
    auto = torch.export.Dim.AUTO
    binder = Binder(model.forward)
    bound = binder.bind(args, kwargs)
    passed = set(binder.names[: len(args)]) | set(kwargs)

    def dims(t: torch.Tensor) -> dict[int, Any]:
        return {0: auto} if t.dim() >= 4 else {i: auto for i in range(t.dim())}

    def spec(value: Any) -> Any:
        return pytree.tree_map(lambda t: dims(t) if isinstance(t, torch.Tensor) else None, value)

    return {name: spec(value) for name, value in bound.items() if name in passed}


def _finite(bound: Any) -> Optional[int]:
    """A range bound as an int, or ``None`` for infinity (``int_oo``)."""
    try:
        value = int(bound)
    except Exception:  # sympy's infinities raise assorted errors on int()
        return None
    return value if abs(value) < 2**62 else None


def _shape_rule(ep: torch.export.ExportedProgram) -> ShapeRule:
    """Per user tensor input: fixed sizes as ``(n, n)``, symbolic ones as their value range."""
    inputs = set(ep.graph_signature.user_inputs)
    ranges = {str(k): v for k, v in ep.range_constraints.items()}
    dims = []
    for node in ep.graph.nodes:
        value = node.meta.get("val")
        if (
            node.op != "placeholder"
            or node.name not in inputs
            or not isinstance(value, torch.Tensor)
        ):
            continue
        per_dim = []
        for size in value.shape:
            if isinstance(size, int):
                per_dim.append((size, size))
                continue
            r = ranges.get(str(size.node.expr))
            if r is None:  # an expression of other sizes: accept only the example's value
                hint = int(size.node.hint) if size.node.hint is not None else 0
                per_dim.append((hint, hint))
                continue
            per_dim.append((int(r.lower), _finite(r.upper)))
        dims.append(tuple(per_dim))
    return ShapeRule(tuple(dims))
