"""The save side of an export: a transformed module as JSON structure, graph data and tensors.

A transformed module runs one rewritten GraphModule per input signature and mode. Each becomes a
*variant*: its module tree (containers, ``torch.nn`` leaf modules, graph modules for the graph
and each ``segment_N``), its calling convention, its plan and its graph view::

    structure.json          state: every parameter/buffer name of the model, and which tensor it is
                            variants: [{key, training, capture, parameters, plan, modules: [...]}]
    programs/v0/root.json   the rewritten graph as nodes: fxckpt.checkpoint(segment_0, x), ...
    weights.*               each tensor once, under the model's own name for it

Graphs are written as node lists (:mod:`fxckpt.export.program`), never as code: whatever a
graph calls must be in the table of :mod:`fxckpt.export.targets`, and anything else is refused
here, naming the node. Leaf modules must be ``torch.nn`` classes without hooks (a hook is code).

Tensors are identified by object, so tied weights stay tied and a parameter that both the graph
and a segment read is one Parameter again after loading (its gradient is not split in two).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import warnings
import weakref
from typing import Any, Optional

import torch
import torch.fx
import torch.utils._pytree as pytree

from fxckpt.export.allowlist import names_used, outside, refusal
from fxckpt.export.codec import dump_spec, encode
from fxckpt.export.program import check_part, describe_graph
from fxckpt.errors import ExportError, not_planned
from fxckpt.export.targets import module_class_path
from fxckpt.export.views import view_to_json
from fxckpt.runtime.segment import SegmentModule

__all__ = ["Described", "describe"]

_MODULE_KEYS = frozenset(torch.nn.Module().__dict__)


@dataclasses.dataclass
class Described:
    """Everything :func:`fxckpt.save` writes, in memory."""

    structure: dict[str, Any]
    texts: dict[str, str]
    """Relative path -> text (graph programs, graph views)."""
    tensors: dict[str, torch.Tensor]
    plan: dict[str, Any]


class _Tensors:
    """Each tensor once, keyed by the first name the model gives it (or where the graph keeps it).
    """

    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self.values: dict[str, torch.Tensor] = {}

    def key(self, t: torch.Tensor, fallback: str) -> str:
        name = self.names.get(id(t))
        if name is None:
            name = self.names[id(t)] = fallback
            self.values[name] = t
        return name


def unplanned() -> ExportError:
    """The refusal to save a module that has not planned yet."""
    return ExportError(not_planned(
        "there is no graph to save",
        "call it once in training, or pass example_inputs= to fxckpt.transform or to fxckpt.save"))


def describe(tm: torch.nn.Module) -> Described:
    """Describe every planned variant of the transformed module ``tm`` (latest first)."""
    from fxckpt.module import dispatcher_of

    dispatcher = dispatcher_of(tm)
    whole = dispatcher.whole_graphs()
    last = dispatcher.last if dispatcher.last in whole else (whole[-1] if whole else None)
    if last is None:
        raise unplanned()
    items = sorted(((c.variant_key, c) for c in whole), key=lambda kv: kv[1] is not last)
    tensors = _Tensors()
    state = _state(tm, tensors)
    texts: dict[str, str] = {}
    variants = [_variant(i, key, c, tensors, texts) for i, (key, c) in enumerate(items)]
    structure = {"state": state, "variants": variants, "training": tm.training}
    _warn_outside(structure, texts)
    return Described(structure, texts, dict(tensors.values), last.plan.to_dict())


def _refusal_of(name: str, used: dict[str, set[str]]) -> str:
    return next(str(refusal(kind, name)) for kind, found in used.items() if name in found)


def _warn_outside(structure: dict[str, Any], texts: dict[str, str]) -> None:
    """Names the export uses that a load refuses unless ``allow=`` names them: said once."""
    programs = [json.loads(t) for rel, t in texts.items() if rel.startswith("programs/")]
    used = names_used(structure, programs)
    names = outside(used)
    never = sorted(n for kind, found in used.items() for n in found if refusal(kind, n))
    if never:
        warnings.warn(f"this export uses {', '.join(never)}, which a loaded export may never "
                      f"call ({_refusal_of(never[0], used)}); fxckpt.load will refuse it",
                      stacklevel=3)
        names = [n for n in names if n not in never]
    if names:
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        warnings.warn(
            f"this export uses {shown}, which fxckpt's allowlist of what a loaded export may "
            "call does not hold (it holds what the models fxckpt is tested on need); "
            f"fxckpt.load refuses it unless allow= names them: allow={names!r}",
            stacklevel=3)


def _state(tm: torch.nn.Module, tensors: _Tensors) -> list[dict[str, Any]]:
    """Every parameter and buffer under every name ``tm.state_dict()`` (and ``named_*``) uses."""
    entries = []
    for path, mod in tm.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        for name in [*mod._parameters, *mod._buffers]:
            _check_name(prefix + name, f"the model's tensor {prefix + name!r}")
        for kind, held in (("parameter", mod._parameters), ("buffer", mod._buffers)):
            for name, t in held.items():
                if t is None:
                    continue
                entry = {"name": prefix + name, "key": tensors.key(t, prefix + name), "kind": kind}
                if kind == "parameter":
                    entry["requires_grad"] = t.requires_grad
                else:
                    entry["persistent"] = name not in mod._non_persistent_buffers_set
                entries.append(entry)
    return entries


def _variant(
    i: int, key: Any, compiled: Any, tensors: _Tensors, texts: dict[str, str]
) -> dict[str, Any]:
    from fxckpt.passes.flatten import labelled_graph

    plan = compiled.plan
    offloaded = [s.name for s in plan.segments if getattr(s, "action", "recompute") != "recompute"]
    if offloaded:
        raise ExportError.offloads(f"this plan (segments {offloaded})")
    method = compiled.captured.method
    texts[f"graphs/v{i}.json"] = view_to_json(labelled_graph(compiled.gm, plan))
    return {
        "key": repr(key),
        "loose_key": repr(loose_key(key)),
        "training": plan.training,
        "signature": plan.signature,
        "capture": method,
        "parameters": _parameters(compiled.captured.binder.signature)
        if method == "symbolic_trace"
        else None,
        "plan": plan.to_dict(),
        "view": f"graphs/v{i}.json",
        "modules": _modules(compiled.gm, f"programs/v{i}", tensors, texts),
        "pipeline": None
        if compiled.pipeline is None
        else _pipeline(compiled.pipeline, compiled.gm, i, tensors, texts),
    }


def _pipeline(pipelined: Any, gm: torch.fx.GraphModule, i: int, tensors: _Tensors,
              texts: dict[str, str]) -> dict[str, Any]:
    """A pipelined variant's stages (each its own module tree) and the runner's settings."""
    runner = pipelined.pipeline
    tree = getattr(gm.graph._codegen, "pytree_info", None)
    return {
        "devices": [str(d) for d in runner.devices],
        "chunks": runner.chunks,
        "checkpoint": runner.checkpoint,
        "input_names": runner.input_names,
        "orig_args": None if tree is None else list(tree.orig_args),
        "stages": [
            _modules(m, f"programs/v{i}/stage_{j}", tensors, texts)
            for j, m in enumerate(pipelined.stage_modules)
        ],
    }


def loose_key(key: Any) -> Any:
    """A signature key without tensor shapes and devices (symbolic graphs are shape-generic)."""
    training, spec, leaves = key
    return (
        training,
        spec,
        tuple(("tensor", leaf[2]) if leaf and leaf[0] == "tensor" else leaf for leaf in leaves),
    )


def _parameters(signature: inspect.Signature) -> list[dict[str, Any]]:
    """The model's ``forward`` signature: a symbolic graph takes every parameter positionally."""
    out = []
    for p in signature.parameters.values():
        entry: dict[str, Any] = {"name": p.name, "kind": p.kind.name}
        if p.default is not inspect.Parameter.empty:
            try:
                entry["default"] = encode(p.default, f"the default of forward's {p.name!r}")
            except ExportError:
                entry["default_unsaved"] = True
        out.append(entry)
    return out


def _modules(
    root: torch.nn.Module, code_dir: str, tensors: _Tensors, texts: dict[str, str]
) -> list[dict[str, Any]]:
    """The module tree in pre-order; a module met again is a ``same_as`` reference."""
    entries: list[dict[str, Any]] = []
    seen: dict[int, str] = {}

    def visit(path: str, mod: torch.nn.Module) -> None:
        if id(mod) in seen:
            entries.append({"path": path, "same_as": seen[id(mod)]})
            return
        seen[id(mod)] = path
        entries.append(_module(path, mod, code_dir, tensors, texts))
        for name, child in mod._modules.items():
            if child is not None:
                visit(f"{path}.{name}" if path else name, child)

    visit("", root)
    for e in entries:
        if not all(check_part(p) for p in e["path"].split(".") if e["path"]):
            raise ExportError(f"the module path {e['path']!r} in {code_dir} has a part that an "
                              "export cannot name (letters, digits and underscores only, no "
                              "leading double underscore)")
    return entries


def _module(path: str, mod: torch.nn.Module, code_dir: str, tensors: _Tensors,
            texts: dict[str, str]) -> dict[str, Any]:
    where = f"{code_dir}:{path or '<root>'}"
    entry: dict[str, Any] = {"path": path, **_tensor_slots(mod, where, tensors)}
    if isinstance(mod, torch.fx.GraphModule):
        file = f"{code_dir}/{path or 'root'}.json"
        described = _graph(mod, path or "the rewritten graph", file, texts)
        entry.update(kind="graph", program=file, **described)
    elif type(mod).__name__ == "GuardsFn" and type(mod).__module__.startswith("torch.export"):
        entry["kind"] = (
            "noop"  # export's input-shape guards; a loaded module checks signatures itself
        )
    elif type(mod) is torch.nn.Module:
        entry["kind"] = "container"
    else:
        entry.update(kind="leaf", cls=_leaf_class(mod, path), attrs=_leaf_attrs(mod, path))
    return entry


def _leaf_class(mod: torch.nn.Module, path: str) -> str:
    from fxckpt.signature import has_hooks

    where = f"the module at {path or '<root>'}"
    cls = module_class_path(type(mod), where)
    if has_hooks(mod):
        raise ExportError(f"{where} ({type(mod).__name__}) has hooks: they are code, which an "
                          "export does not hold, and the loaded module would compute without "
                          "them. Remove the hooks before saving")
    return cls


def _tensor_slots(mod: torch.nn.Module, where: str, tensors: _Tensors) -> dict[str, Any]:
    def key(t: Optional[torch.Tensor], name: str) -> Optional[str]:
        return None if t is None else tensors.key(t, f"{where}.{name}")

    attributes = [n for n, v in vars(mod).items() if isinstance(v, torch.Tensor)]
    for name in [*mod._parameters, *mod._buffers, *attributes]:
        _check_name(name, f"the tensor {name!r} of {where}")
    return {
        "params": {n: key(p, n) for n, p in mod._parameters.items()},
        "buffers": {
            n: [key(b, n), n not in mod._non_persistent_buffers_set]
            for n, b in mod._buffers.items()
        },
        "tensors": {n: key(v, n) for n, v in vars(mod).items() if isinstance(v, torch.Tensor)},
    }


def _check_name(name: str, where: str) -> None:
    if not all(check_part(part) for part in name.split(".")):
        raise ExportError(f"{where}: an export names modules and tensors with letters, digits "
                          "and underscores only (no leading double underscore)")


def _graph(
    gm: torch.fx.GraphModule, path: str, file: str, texts: dict[str, str]
) -> dict[str, Any]:
    if isinstance(gm, SegmentModule) and gm.offloader is not None:
        raise ExportError.offloads(path)
    program = describe_graph(gm, path)
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            _check_attribute(gm, str(n.target), f"node {n.name!r} of {path}")
    texts[file] = json.dumps(program, indent=0)
    specs = {a: dump_spec(v, f"{path}.{a}") for a, v in vars(gm).items()
             if isinstance(v, pytree.TreeSpec)}
    described: dict[str, Any] = {"class_name": type(gm).__name__, "attrs": {}, "specs": specs}
    if isinstance(gm, SegmentModule):
        described["segment"] = {"name": gm.name, "restores": list(gm.restores)}
        if gm.kept:
            described["segment"]["kept"] = gm.kept
        for flag in ("early_stop", "draws"):  # both default to true
            if not getattr(gm, flag):
                described["segment"][flag] = False
    return described


def _check_attribute(gm: torch.nn.Module, target: str, where: str) -> None:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    if not isinstance(value, (torch.Tensor, torch.nn.Module, pytree.TreeSpec)):
        raise ExportError(f"{where} reads {target!r}, a {type(value).__name__}; an export holds "
                          "graph attributes that are modules, tensors or pytree specs only")


def _tensor_list(value: Any) -> bool:
    """A list of tensors or weak references to them (rebuilt from the parameters on load)."""
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(v, (torch.Tensor, weakref.ReferenceType)) for v in value)


def _leaf_attrs(mod: torch.nn.Module, path: str) -> dict[str, Any]:
    attrs = {}
    for name, value in vars(mod).items():
        if (
            name in _MODULE_KEYS
            or isinstance(value, (torch.Tensor, torch.nn.Module))
            or _tensor_list(value)
        ):
            # tensors are linked by key; lists of them (RNNs' _flat_weights) are rebuilt on load
            continue
        where = f"attribute {name!r} of {type(mod).__name__} at {path or '<root>'}"
        if not check_part(name) or name == "forward":
            raise ExportError(f"{where}: an export cannot name this attribute")
        attrs[name] = encode(value, where)
    return attrs
