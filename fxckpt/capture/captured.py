"""Capture: turn an ``nn.Module`` into a ``torch.fx.GraphModule`` that computes what it computes.

``torch.fx.symbolic_trace`` (with :class:`~fxckpt.capture.tracer.FxckptTracer`) comes first: it
keeps leaf modules as ``call_module`` nodes, so module paths and the generated code stay
readable, and it is shape-free. Non-tensor arguments seen at the call (``mask=None``,
``return_dict=False``) are passed as ``concrete_args`` so Python branches on them resolve. When
symbolic tracing fails (data-dependent Python, Hugging Face models) and inputs are known,
``torch.export`` (non-strict, training IR, dynamic shapes) captures the graph instead; see
:mod:`fxckpt.capture.exporter`.

    model --symbolic_trace--> GraphModule            (no inputs needed, any shape)
          `-export(args)----> GraphModule (aten)     (fallback, needs inputs; dynamic dims)

Either way the graph must compute what the model computes, or capture refuses:

* custom autograd Functions stay opaque calls (their backward runs);
* modules with hooks are called as they are, so hooks fire on real tensors once per call;
* with FSDP2 (``fully_shard``), modules owning parameters are called too, so parameters are
  always read live, sharded or whole as FSDP left them (:mod:`fxckpt.capture.sharding`);
* a forward that draws numpy/Python random numbers or changes Python state is refused with
  :class:`~fxckpt.errors.CaptureError`, naming what changed (:mod:`fxckpt.capture.traceless`);
* global module hooks are refused: a graph cannot call them once per module.

A graph is captured per mode of every module and per autocast state (the caller's key), because
both methods bake ``self.training`` and autocast casts into the graph.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any, Optional

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import is_fake
from torch.fx.graph import _PyTreeCodeGen

from fxckpt.errors import CaptureError

from fxckpt.capture.exporter import ShapeRule, export_graph
from fxckpt.capture.guards import Guards, build_guards
from fxckpt.capture.reads import Reads, recording
from fxckpt.capture.isolation import isolated
from fxckpt.capture.regions import outline_regions
from fxckpt.capture.sharding import (full_parameters, parameter_owners, root_gathered,
                                    sharding_key)
from fxckpt.capture.traceless import Traceless
from fxckpt.capture.tracer import FxckptTracer, to_graph_module
from fxckpt.runtime.assign import Assignment, assign
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
    """:func:`~fxckpt.capture.sharding.sharding_key` of ``model`` when captured."""
    guards: Guards = Guards()
    """The Python facts the graph depends on (:mod:`fxckpt.capture.guards`)."""

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
        bound = self.binder.by_name(args, kwargs)  # swapped-in modules: named as forward's
        return [bound[str(n.target)] for n in self.gm.graph.nodes if n.op == "placeholder"]

    def call(self, gm: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """Run ``gm`` (this graph, or a rewrite of it) as the model would run on these inputs."""
        if self.method == SYMBOLIC:
            return gm(*self.binder.bind(args, kwargs).values())
        return gm(*args, **kwargs)


def capture(
    model: torch.nn.Module, args: Optional[tuple] = None, kwargs: Optional[dict] = None, *,
    method: str = "auto", live: Optional[torch.nn.Module] = None,
) -> Captured:
    """Capture ``model`` as a GraphModule; see the module docstring for the order of methods.

    ``method`` is ``auto``, ``symbolic_trace`` or ``export``. ``live`` is the module whose state
    ``model`` views (the transformed module, for a view of it): the guards check its state.
    Captures run one at a time, unseen by other threads (:mod:`fxckpt.capture.isolation`).
    """
    live = model if live is None else live
    with isolated(), root_gathered(model, live):
        return _capture(model, args, kwargs, method, live)


def _capture(model: torch.nn.Module, args: Optional[tuple], kwargs: Optional[dict],
             method: str, live: torch.nn.Module) -> Captured:
    _refuse_global_hooks()
    binder = Binder(model.forward)
    modules = list(model.named_modules())
    hooked = tuple(path for path, m in modules if path and has_hooks(m))
    sharding = sharding_key(model)
    # FSDP: parameters are read by calling the modules that own them
    owners = parameter_owners(model) if any(sharding) else ()
    compiled = tuple(path for path, m in modules if path and is_compiled(m))
    called = tuple(dict.fromkeys(hooked + compiled + tuple(owners)))
    quiet = [m for _, m in modules if has_hooks(m)]
    everything = [m for _, m in model.named_modules(remove_duplicate=False)]

    def guards(reads: Reads) -> Guards:
        return build_guards(live, reads, {id(model): live})

    failures: list[tuple[str, BaseException]] = []
    if method != EXPORT:
        clean = Traceless(model, quiet)
        try:
            with clean, recording(everything) as reads:
                gm = _symbolic(model, binder, args, kwargs, called)
        except Exception as e:  # any tracer failure: fall back and report it if export fails too
            failures.append((SYMBOLIC, e))
        else:
            _refuse_changes(model, clean.changes)
            _assignments(gm, clean.assigned, live, reads)
            outline_regions(gm)
            log.debug("captured %s with symbolic_trace (%d nodes)", type(model).__name__,
                      len(gm.graph.nodes))
            return Captured(gm, SYMBOLIC, binder, None, hooked, model, sharding, guards(reads))
        if method == SYMBOLIC or (args is None and kwargs is None):
            _refuse_changes(model, clean.changes)
            have_inputs = args is not None or kwargs is not None
            raise CaptureError(_message(model, failures, have_inputs=have_inputs,
                                        method=method)) from failures[-1][1]
    if args is None and kwargs is None:
        raise CaptureError(
            f"capture='export' needs the call's inputs to capture {type(model).__name__}: call "
            "the transformed module, or pass example_inputs= to fxckpt.transform"
        )
    clean = Traceless(model, quiet)
    try:
        # export runs opaque modules' forward on fakes too
        with clean, full_parameters(model), recording(everything) as reads:
            exported = export_graph(model, tuple(args or ()), dict(kwargs or {}), called)
    except CaptureError:
        raise
    except Exception as e:
        failures.append((EXPORT, e))
        _refuse_changes(model, clean.changes)
        message = _message(model, failures, have_inputs=True, method=method)
        generators = reads.of_type(torch.Generator)
        if generators:
            message += (f"\n  - the forward draws from a torch.Generator it owns ("
                        f"{', '.join(generators)}), which torch.export cannot capture; "
                        "symbolic_trace replays such draws exactly (capture='graph' tries it "
                        "first)")
        raise CaptureError(message) from e
    _refuse_changes(model, clean.changes + _changed(model, reads))
    _assignments(exported.gm, clean.assigned, live, reads)
    log.info(
        "captured %s with torch.export (%s shapes; %s)",
        type(model).__name__,
        "dynamic" if exported.shapes.dynamic else "fixed",
        f"symbolic_trace failed: {_first_line(failures[0][1])}" if failures else "as asked",
    )
    return Captured(exported.gm, EXPORT, binder, exported.shapes, hooked, model, sharding,
                    guards(reads))


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
    _drop_value_checks(graph)
    return to_graph_module(tracer.root, graph, type(model).__name__)


def _assignments(gm: torch.fx.GraphModule, assigned: list[tuple[str, str, Any]],
                 live: torch.nn.Module, reads: Reads) -> None:
    """Attributes the forward assigned (``self.attn_map = attn``), which capture removed again:
    a traced value is set by the graph every call (:mod:`fxckpt.runtime.assign`), a plain value
    is set now (as the model's own call leaves it); a tensor export made cannot be set."""
    for index, (path, name, value) in enumerate(assigned):
        module = live.get_submodule(path)
        reads.forget(module, name)
        where = f"{path}.{name}" if path else name
        leaves = pytree.tree_leaves(value)
        if any(isinstance(v, torch.fx.Proxy) for v in leaves):
            _assign_in_graph(gm, Assignment(module, name, where), value, index)
        elif any(isinstance(v, torch.Tensor) and is_fake(v) for v in leaves):
            raise CaptureError(
                f"the forward of {type(live).__name__} assigns a tensor it computes to "
                f"`{where}`, and torch.export (which captured it) cannot replay an assignment. "
                f"Return the tensor from forward instead, or register `{where}` as a buffer "
                f"(register_buffer) and copy into it in place (self.{name}.copy_(...)), which "
                "fxckpt replays every call"
            )
        else:
            setattr(module, name, value)


def _assign_in_graph(gm: torch.fx.GraphModule, target: Assignment, value: Any,
                     index: int) -> None:
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    made = [v.node for v in pytree.tree_leaves(value) if isinstance(v, torch.fx.Proxy)]
    last = max(made, key=order.__getitem__)
    attribute = f"fxckpt_assign_{index}"
    while hasattr(gm, attribute):
        attribute += "_"
    setattr(gm, attribute, target)
    with graph.inserting_after(last), warnings.catch_warnings():
        # fx expects get_attr to read modules and tensors; this one reads a plain object
        warnings.filterwarnings("ignore", message="Attempted to insert a get_attr Node")
        holder = graph.get_attr(attribute)
    with graph.inserting_after(holder):
        argument = pytree.tree_map(lambda v: v.node if isinstance(v, torch.fx.Proxy) else v,
                                   value)
        graph.call_function(assign, (holder, argument))
    gm.recompile()


def _drop_value_checks(graph: torch.fx.Graph) -> None:
    """Remove torch.fx's ``assert scale == 0.5`` checks of the non-tensor arguments it was given:
    the dispatcher's key already serves each value its own graph (by bits: a NaN argument, which
    equals no value, would fail its check every call)."""
    for node in list(graph.nodes):
        message = node.args[1] if node.target is torch._assert and len(node.args) > 1 else None
        if isinstance(message, str) and "has been specialized to have value" in message:
            condition = node.args[0]
            graph.erase_node(node)
            if isinstance(condition, torch.fx.Node) and not condition.users:
                graph.erase_node(condition)


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


def _changed(model: torch.nn.Module, reads: Reads) -> list[str]:
    """Attributes the forward changed that torch.export put back by itself (Traceless
    cannot see those), described as Traceless describes changes."""
    paths = {id(m): p for p, m in model.named_modules()}
    out = []
    for obj, name, before, now in reads.changed():
        path = paths.get(id(obj))
        where = name if not path else f"{path}.{name}"
        out.append(f"the forward changes `{where}` (from {before!r:.40} to {now!r:.40})")
    return out


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


def _message(model: torch.nn.Module, failures: list, have_inputs: bool, method: str) -> str:
    name = type(model).__name__
    asked = "" if method == "auto" else f" with capture={method!r}"
    lines = [f"fxckpt could not capture {name} as a torch.fx graph{asked}."]
    for how, err in failures:
        lines.append(f"  - {how} failed with {_first_line(err)}")
    lines.append("How to fix it:")
    if method == SYMBOLIC:
        lines.append("  - let fxckpt fall back to torch.export: capture='graph';")
    elif not have_inputs:
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
