"""A GraphModule's graph as a list of nodes, and the graph rebuilt from it with torch.fx's API.

    {"pytree": null,
     "nodes": [{"name": "x", "op": "placeholder", "target": "x", "args": [], "kwargs": {}},
               {"name": "relu", "op": "call_function", "target": "torch.relu",
                "args": [{"__node__": "x"}], "kwargs": {}},
               {"name": "output", "op": "output", "target": "output",
                "args": [{"__node__": "relu"}], "kwargs": {}}]}

Loading calls ``graph.create_node`` for each entry and lets torch.fx generate and compile the
forward from that graph, so no text of the export is ever executed. Call targets come from the
table of :mod:`fxckpt.export.targets`, arguments are tagged data (:mod:`fxckpt.export.codec`).
torch.fx does print a few strings of the graph into the code it generates (node names,
placeholder and attribute targets, method names, keyword names, the pytree calling
convention's argument names and keys), so every one of them is checked against a strict
pattern first, and attribute targets must lead to modules, tensors or specs the export itself
put in place (:func:`install`). A graph that needs anything else is refused at save time,
naming the node.
"""

from __future__ import annotations

import keyword
import re
from typing import Any, Optional

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.graph import CodeGen, _PyTreeCodeGen, _PyTreeInfo

from fxckpt.export.bound import EXAMPLE, example_from, example_of
from fxckpt.export.codec import decode, dump_spec, encode, load_spec
from fxckpt.errors import ExportError
from fxckpt.export.targets import (GETATTR_NAMES, METHODS, function_name,
                                   resolve_function, table_name)

__all__ = ["describe_graph", "build_graph", "install", "check_part"]

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PLACEHOLDER = re.compile(r"\*{0,2}[A-Za-z_][A-Za-z0-9_]*")
_PART = re.compile(r"(?!__)[A-Za-z0-9_]+")
_OPS = frozenset({"placeholder", "get_attr", "call_function", "call_method", "call_module",
                  "output"})
_MISSING = object()


def describe_graph(gm: torch.fx.GraphModule, where: str) -> dict[str, Any]:
    """``gm``'s graph as data; :class:`ExportError` naming a node that cannot be saved."""
    nodes = []
    for n in gm.graph.nodes:
        at = f"node {n.name!r} ({n.op} {_shown(n.target)}) of {where}"
        target = _target(n, at)
        op = n.op
        if op == "call_method":  # x.view(...) as torch.Tensor.view(x, ...): a typed receiver
            op, target = "call_function", f"torch.Tensor.{target}"
        entry = {
            "name": n.name, "op": op, "target": target,
            "args": [encode(a, at, _name) for a in n.args],
            "kwargs": {k: encode(v, at, _name) for k, v in n.kwargs.items()},
        }
        example = example_of(n) if n.op == "placeholder" else None
        if example is not None:  # the shapes a load measures the graph at (export/bound.py)
            entry["example"] = example
        nodes.append(entry)
    return {"pytree": _pytree(gm, where), "nodes": nodes}


def _name(node: torch.fx.Node) -> str:
    return node.name


def _shown(target: Any) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", repr(target))


def _target(n: torch.fx.Node, where: str) -> str:
    if n.op == "call_function":
        name = function_name(n.target, where)
        if name == "builtins.getattr":
            _check_getattr(list(n.args), n.kwargs, where)
        return name
    if n.op == "call_method" and n.target not in METHODS:
        raise ExportError(f"{where} calls the method {n.target!r}, which is not one of the Tensor "
                          "methods a loaded export may call")
    return str(n.target)


def _check_getattr(args: list[Any], kwargs: dict[str, Any], where: str,
                   loading: bool = False) -> None:
    from fxckpt.export.allowlist import permits

    if (kwargs or len(args) not in (2, 3) or args[1] not in GETATTR_NAMES
            or loading and not permits("getattr", args[1])):
        shown = args[1] if len(args) > 1 else None
        raise ExportError(f"{where} reads the attribute {str(shown)[:80]!r} with getattr; a "
                          "loaded export reads only Tensor properties "
                          f"({', '.join(GETATTR_NAMES)})")


def _pytree(gm: torch.fx.GraphModule, where: str) -> Optional[dict[str, Any]]:
    """The calling convention of an exported graph (``forward(self, *orig_args)`` + specs)."""
    codegen = gm.graph._codegen
    if type(codegen) is CodeGen:
        return None
    info = getattr(codegen, "pytree_info", None)
    if type(codegen) is not _PyTreeCodeGen or info is None:
        raise ExportError(f"{where} generates its code with {type(codegen).__name__}, which an "
                          "export cannot hold")
    return {"orig_args": list(info.orig_args),
            "in_spec": None if info.in_spec is None else dump_spec(info.in_spec, where),
            "out_spec": None if info.out_spec is None else dump_spec(info.out_spec, where)}


def build_graph(data: dict[str, Any], where: str) -> tuple[torch.fx.Graph, Optional[_PyTreeInfo]]:
    """A new graph with the nodes ``data`` lists (validated), and its pytree calling convention."""
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    entries = data.get("nodes")
    if not isinstance(entries, list) or not entries:
        raise ExportError(f"{where} has no node list")
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise ExportError(f"{where}: node {i} is not an object")
        at = f"node {str(e.get('name'))[:60]!r} of {where}"
        name = e.get("name")
        if not (isinstance(name, str) and _IDENT.fullmatch(name)) or name in env or name == "self":
            raise ExportError(f"{at}: a node name must be a new Python identifier (not self)")
        if (e.get("op") == "output") != (i == len(entries) - 1):
            raise ExportError(f"{at}: a graph has exactly one output node, its last")
        env[name] = _node(graph, e, env, at)
    return graph, _pytree_info(data.get("pytree"), where)


def _node(graph: torch.fx.Graph, e: dict[str, Any], env: dict[str, torch.fx.Node],
          where: str) -> torch.fx.Node:
    op, target = e.get("op"), e.get("target")
    raw_args, raw_kwargs = e.get("args", []), e.get("kwargs", {})
    if op not in _OPS or not isinstance(raw_args, list) or not isinstance(raw_kwargs, dict):
        raise ExportError(f"{where}: not a valid node (op {str(op)[:40]!r})")
    if not all(_keyword(k) for k in raw_kwargs):
        raise ExportError(f"{where}: keyword argument names must be Python identifiers")
    args = tuple(decode(a, env) for a in raw_args)
    kwargs = {k: decode(v, env) for k, v in raw_kwargs.items()}
    resolved = _resolve_target(op, target, args, kwargs, where)
    node = graph.create_node(op, resolved, args, kwargs, name=e["name"])
    if e.get("example") is not None:
        if op != "placeholder":
            raise ExportError(f"{where}: only a placeholder has an example")
        node.meta[EXAMPLE] = example_from(e["example"], where)
    return node


def _keyword(name: Any) -> bool:
    return isinstance(name, str) and bool(_IDENT.fullmatch(name)) and not keyword.iskeyword(name)


def _resolve_target(op: str, target: Any, args: tuple, kwargs: dict[str, Any], where: str) -> Any:
    if not isinstance(target, str):
        raise ExportError(f"{where}: the target must be a string")
    if op == "call_function":
        fn = resolve_function(target, where)
        if target == "builtins.getattr":
            _check_getattr(list(args), kwargs, where, loading=True)
        return fn
    if op == "call_method":
        raise ExportError(f"{where} calls the method {target[:80]!r} on whatever its first "
                          "argument is; an export holds Tensor methods as torch.Tensor.<name> "
                          "calls, which check that it is a tensor")
    if op == "placeholder" and (not _PLACEHOLDER.fullmatch(target) or len(args) > 1 or kwargs
                                or _has_node(args)):
        raise ExportError(f"{where}: a placeholder's target must be an argument name, its only "
                          "argument a default value")
    if op == "output" and (target != "output" or len(args) != 1 or kwargs):
        raise ExportError(f"{where}: the output node takes one argument")
    if op in ("get_attr", "call_module") and (not all(check_part(p) for p in target.split("."))
                                              or op == "get_attr" and (args or kwargs)):
        raise ExportError(f"{where}: {target[:80]!r} is not a path of the module's own attributes")
    return target


def _has_node(value: Any) -> bool:
    if isinstance(value, torch.fx.Node):
        return True
    if isinstance(value, (list, tuple)):
        return any(_has_node(v) for v in value)
    if isinstance(value, dict):
        return any(_has_node(v) for v in value.values())
    return isinstance(value, slice) and _has_node((value.start, value.stop, value.step))


def check_part(part: Any) -> bool:
    """A module path component an export may use (``layers``, ``0``; no dunder names)."""
    return isinstance(part, str) and _PART.fullmatch(part) is not None


def _pytree_info(data: Any, where: str) -> Optional[_PyTreeInfo]:
    if data is None:
        return None
    if not (isinstance(data, dict) and isinstance(data.get("orig_args"), list)):
        raise ExportError(f"{where}: the pytree calling convention is not valid")
    orig_args = data["orig_args"]
    if not all(isinstance(a, str) and _PLACEHOLDER.fullmatch(a) for a in orig_args):
        raise ExportError(f"{where}: the pytree calling convention's argument names must be "
                          "identifiers")
    in_spec = None if data.get("in_spec") is None else load_spec(data["in_spec"], where)
    out_spec = None if data.get("out_spec") is None else load_spec(data["out_spec"], where)
    if (in_spec is not None and in_spec.type is tuple and in_spec.num_children == 2
            and in_spec.child(1).type is dict):
        if not all(_keyword(k) for k in in_spec.child(1).context):
            raise ExportError(f"{where}: the keyword arguments of the pytree calling convention "
                              "must be identifiers")
    return _PyTreeInfo(orig_args, in_spec, out_spec)  # type: ignore[arg-type]  # None: no spec


def install(gm: torch.fx.GraphModule, graph: torch.fx.Graph, info: Optional[_PyTreeInfo],
            where: str) -> None:
    """Give ``gm`` its graph (torch.fx generates and compiles the forward from it)."""
    objects: dict[torch.fx.Node, str] = {}  # get_attr nodes of modules and pytree specs
    for n in graph.nodes:
        if n.op in ("get_attr", "call_module"):
            value = _attribute(gm, str(n.target), f"node {n.name!r} of {where}")
            if n.op == "call_module" and not isinstance(value, torch.nn.Module):
                raise ExportError(f"node {n.name!r} of {where} calls {n.target!r}, which is not a "
                                  "module")
            if isinstance(value, _CONTAINERS):
                raise ExportError(f"node {n.name!r} of {where} reaches the container "
                                  f"{n.target!r}; a loaded graph never touches a torch.nn "
                                  "container (its items are reached by any name)")
            if n.op == "get_attr" and not isinstance(value, torch.Tensor):
                objects[n] = "module" if isinstance(value, torch.nn.Module) else "spec"
        for i, a in enumerate([*n.args, *n.kwargs.values()]):
            for used in _nodes_in(a):
                if used in objects and not _takes(n, i, objects[used]):
                    raise ExportError(
                        f"node {n.name!r} of {where} passes the {objects[used]} "
                        f"{used.target!r} to {_shown(n.target)}; a loaded graph hands modules "
                        "to fxckpt's runtime and pytree specs to torch's pytree functions only")
    if info is not None:
        graph._codegen = _PyTreeCodeGen(info)
    try:
        graph.lint()
        gm.graph = graph
    except (RuntimeError, SyntaxError, TypeError, ValueError) as e:
        raise ExportError(f"{where}: torch.fx cannot build the saved graph "
                          f"({type(e).__name__}: {e})") from None


_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.ParameterList,
               torch.nn.ParameterDict, torch.nn.Sequential)


def _nodes_in(value: Any) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(value, found.append)
    return found


def _takes(node: torch.fx.Node, position: int, kind: str) -> bool:
    """Whether ``node`` takes a module (or a pytree spec) as its argument at ``position``: the
    runtime's recompute and grad-mode / autocast wrappers take the module they run, torch's
    pytree functions the spec. Anywhere else a module could be written into (``setitem`` on a
    container) or handed back to Python."""
    if node.op != "call_function" or len(node.kwargs) and position >= len(node.args):
        return False
    return position in _OBJECT_ARGUMENTS.get((table_name(node.target), kind), ())


_OBJECT_ARGUMENTS: dict[tuple[Optional[str], str], tuple[int, ...]] = {
    ("fxckpt.checkpoint", "module"): (0,),
    ("fxckpt.sized_mask", "module"): (0,),
    ("torch.ops.higher_order.wrap_with_set_grad_enabled", "module"): (1,),
    ("torch.ops.higher_order.wrap_with_autocast", "module"): (4,),
    ("torch.utils._pytree.tree_unflatten", "spec"): (1,),
    ("torch.fx._pytree.tree_flatten_spec", "spec"): (1,),
}
"""``(runtime function, kind) -> positions`` where a loaded graph may pass a module or spec."""


def _attribute(gm: torch.nn.Module, target: str, where: str) -> Any:
    """What ``target`` names, reached only through what the export put in place."""
    current: Any = gm
    for part in target.split("."):
        owned = _owned(current, part) if isinstance(current, torch.nn.Module) else _MISSING
        if owned is _MISSING or getattr(current, part, _MISSING) is not owned:
            raise ExportError(f"{where}: {target!r} is not a module, parameter, buffer or tensor "
                              "the export holds")
        current = owned
    return current


def _owned(mod: torch.nn.Module, part: str) -> Any:
    for store in (mod._modules, mod._parameters, mod._buffers):
        if part in store:
            return _MISSING if store[part] is None else store[part]
    value = mod.__dict__.get(part, _MISSING)
    return value if isinstance(value, (torch.Tensor, pytree.TreeSpec)) else _MISSING
