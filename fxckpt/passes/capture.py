"""Capture: turn an ``nn.Module`` into a ``torch.fx.GraphModule`` that computes what it computes.

``torch.fx.symbolic_trace`` (with :class:`~fxckpt.passes.tracer.FxckptTracer`) comes first: it
keeps leaf modules as ``call_module`` nodes, so module paths and the generated code stay
readable, and it is shape-free. Non-tensor arguments seen at the call (``mask=None``,
``return_dict=False``) are passed as ``concrete_args`` so Python branches on them resolve. When
symbolic tracing fails (data-dependent Python, Hugging Face models) and inputs are known,
``torch.export`` (non-strict, training IR, dynamic shapes) captures the graph instead; see
:mod:`fxckpt.passes.exporter`.

    model --symbolic_trace--> GraphModule            (no inputs needed, any shape)
          `-export(args)----> GraphModule (aten)     (fallback, needs inputs; dynamic dims)

Either way the graph must compute what the model computes, or capture refuses:

* custom autograd Functions stay opaque calls (their backward runs);
* modules with hooks are called as they are, so hooks fire on real tensors once per call;
* with FSDP2 (``fully_shard``), modules owning parameters are called too, so parameters are
  always read live, sharded or whole as FSDP left them (:mod:`fxckpt.passes.sharding`);
* a forward that draws numpy/Python random numbers or changes Python state is refused with
  :class:`~fxckpt.errors.CaptureError`, naming what changed (:mod:`fxckpt.passes.state_guard`);
* global module hooks are refused: a graph cannot call them once per module.

A graph is captured per mode of every module and per autocast state (the caller's key), because
both methods bake ``self.training`` and autocast casts into the graph.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.graph import _PyTreeCodeGen

from fxckpt.errors import CaptureError
from fxckpt.passes.exporter import ShapeRule, export_graph
from fxckpt.passes.regions import outline_regions
from fxckpt.passes.sharding import (full_parameters, parameter_owners, refuse_sharded_root,
                                    sharding_key)
from fxckpt.passes.state_guard import StateGuard
from fxckpt.passes.tracer import FxckptTracer, to_graph_module
from fxckpt.signature import Binder, Shapes, has_hooks, is_compiled, is_static_value

__all__ = ["Captured", "capture", "SYMBOLIC", "EXPORT"]

log = logging.getLogger(__name__)

SYMBOLIC = "symbolic_trace"
EXPORT = "export"


@dataclasses.dataclass
class Captured:
    """A captured graph, which inputs it serves, and how to feed it the model's call arguments."""

    gm: torch.fx.GraphModule
    method: str
    """``symbolic_trace`` (placeholders are the forward's parameters) or ``export``."""
    binder: Binder
    """Binds calls to the model's ``forward`` parameters."""
    shape_rule: Optional[ShapeRule] = None
    """For exported graphs: the shapes the graph accepts (``None``: any shape)."""
    hooked: tuple[str, ...] = ()
    """Modules with hooks, called as they are; kept out of recompute segments (but FSDP's)."""
    model: Optional[torch.nn.Module] = None
    """What was captured (its children and hook tables are the transformed module's)."""
    sharding: tuple[bool, ...] = ()
    """:func:`~fxckpt.passes.sharding.sharding_key` of ``model`` when captured."""

    def accepts(self, shapes: Shapes) -> bool:
        """True when this graph computes the model for tensors of these shapes, as sharded now."""
        if self.model is not None and sharding_key(self.model) != self.sharding:
            return False  # fully_shard since: the graph reads parameters FSDP replaced
        return self.shape_rule is None or self.shape_rule.accepts(shapes)

    @property
    def shape_free(self) -> bool:
        """True when the graph serves more than the shapes it was captured with."""
        return self.shape_rule is None or self.shape_rule.dynamic

    def graph_args(self, args: tuple, kwargs: dict) -> list:
        """The values of the graph's placeholders, in order, for a call ``model(*args, **kwargs)``.
        """
        if self.method == SYMBOLIC:
            return list(self.binder.bind(args, kwargs).values())
        if isinstance(self.gm.graph._codegen, _PyTreeCodeGen):  # placeholders: the call's leaves
            return pytree.tree_leaves((args, kwargs))
        bound = self.binder.bind(
            args, kwargs
        )  # swapped-in modules: placeholders named as forward's
        return [bound[str(n.target)] for n in self.gm.graph.nodes if n.op == "placeholder"]

    def call(self, gm: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """Run ``gm`` (this graph, or a rewrite of it) as the model would run on these inputs."""
        if self.method == SYMBOLIC:
            return gm(*self.binder.bind(args, kwargs).values())
        return gm(*args, **kwargs)


def capture(
    model: torch.nn.Module, args: Optional[tuple] = None, kwargs: Optional[dict] = None
) -> Captured:
    """Capture ``model`` as a GraphModule; see the module docstring for the order of methods."""
    _refuse_global_hooks()
    binder = Binder(model.forward)
    modules = list(model.named_modules())
    hooked = tuple(path for path, m in modules if path and has_hooks(m))
    sharding = sharding_key(model)
    if any(sharding):  # FSDP: parameters are read by calling the modules that own them
        refuse_sharded_root(model)
    owners = parameter_owners(model) if any(sharding) else ()
    compiled = tuple(path for path, m in modules if path and is_compiled(m))
    called = tuple(dict.fromkeys(hooked + compiled + tuple(owners)))
    quiet = [m for _, m in modules if has_hooks(m)]
    failures: list[tuple[str, BaseException]] = []
    guard = StateGuard(model, quiet)
    try:
        with guard:
            gm = _symbolic(model, binder, args, kwargs, called)
    except Exception as e:  # any tracer failure: fall back and report it if export fails too
        failures.append((SYMBOLIC, e))
    else:
        _refuse_changes(model, guard.changes)
        log.debug(
            "captured %s with symbolic_trace (%d nodes)", type(model).__name__, len(gm.graph.nodes)
        )
        return Captured(gm, SYMBOLIC, binder, None, hooked, model, sharding)
    if args is None and kwargs is None:
        _refuse_changes(model, guard.changes)
        raise CaptureError(_message(model, failures, have_inputs=False)) from failures[0][1]
    guard = StateGuard(model, quiet)
    try:
        with guard, full_parameters(model):  # export runs opaque modules' forward on fakes too
            exported = export_graph(model, tuple(args or ()), dict(kwargs or {}), called)
    except CaptureError:
        raise
    except Exception as e:
        failures.append((EXPORT, e))
        _refuse_changes(model, guard.changes)
        raise CaptureError(_message(model, failures, have_inputs=True)) from e
    _refuse_changes(model, guard.changes)
    log.info(
        "captured %s with torch.export (%s shapes; symbolic_trace failed: %s)",
        type(model).__name__,
        "dynamic" if exported.shapes.dynamic else "fixed",
        _first_line(failures[0][1]),
    )
    return Captured(exported.gm, EXPORT, binder, exported.shapes, hooked, model, sharding)


def _symbolic(
    model: torch.nn.Module,
    binder: Binder,
    args: Optional[tuple],
    kwargs: Optional[dict],
    leaves: tuple[str, ...],
) -> torch.fx.GraphModule:
    concrete = None
    if args is not None or kwargs is not None:
        bound = binder.bind(tuple(args or ()), dict(kwargs or {}))
        concrete = {k: v for k, v in bound.items() if is_static_value(v)} or None
    tracer = FxckptTracer(leaves=frozenset(leaves))
    graph = tracer.trace(model, concrete_args=concrete)
    gm = to_graph_module(tracer.root, graph, type(model).__name__)
    outline_regions(gm)
    return gm


def _refuse_global_hooks() -> None:
    m = torch.nn.modules.module
    tables = {"forward": m._global_forward_hooks, "forward pre-": m._global_forward_pre_hooks,
              "backward": m._global_backward_hooks, "backward pre-": m._global_backward_pre_hooks}
    found = [kind for kind, table in tables.items() if table]
    if found:
        raise CaptureError(
            f"global module {' and '.join(found)} hooks are registered "
            "(torch.nn.modules.module.register_module_*_hook); they fire for every module call, "
            "which a captured graph cannot reproduce. Register the hooks on the modules you need "
            "instead (module.register_forward_hook): fxckpt calls those modules as they are, so "
            "their hooks fire"
        )


def _refuse_changes(model: torch.nn.Module, changes: list[str]) -> None:
    if not changes:
        return
    listed = "\n".join(f"  - {c}" for c in changes)
    raise CaptureError(
        f"fxckpt cannot capture {type(model).__name__} exactly: while it was traced,\n{listed}\n"
        "A captured graph replays what it saw while tracing on every call, so it would diverge "
        "from the model. How to fix it:\n"
        "  - draw random numbers with torch (torch.rand, torch.bernoulli, dropout), which fxckpt "
        "replays exactly, or compute them outside the model and pass them in as inputs (Hugging "
        "Face Wav2Vec2's SpecAugment: set config.mask_time_prob=0 and mask_feature_prob=0, and "
        "mask the inputs before the call);\n"
        "  - keep counters and other state that forward updates in a buffer "
        "(self.register_buffer('step', torch.zeros(()))) and update it in place "
        "(self.step.add_(1)), which fxckpt replays every call."
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _message(model: torch.nn.Module, failures: list, have_inputs: bool) -> str:
    name = type(model).__name__
    lines = [f"fxckpt could not capture {name} as a torch.fx graph."]
    for method, err in failures:
        lines.append(f"  - {method} failed with {_first_line(err)}")
    lines.append("How to fix it:")
    if not have_inputs:
        lines.append(
            "  - pass example inputs (fxckpt.transform(model, ..., example_inputs=(x,)) or call "
            "the transformed module) so torch.export can capture what symbolic tracing cannot;"
        )
    lines += [
        "  - give the tracer fixed values for Python-level arguments (concrete_args): non-tensor "
        "arguments at the call are already treated so;",
        "  - keep data-dependent Python (`if x.sum() > 0`) inside a leaf module or a function "
        "registered with torch.fx.wrap, or rewrite it with torch.where / torch.cond;",
        "  - see docs/guide.md, 'When a model does not trace'.",
    ]
    return "\n".join(lines)
