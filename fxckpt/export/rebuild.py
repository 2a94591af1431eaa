"""The load side of an export: module trees rebuilt from structure, graph data and tensors.

Each module entry becomes one of

* a plain ``nn.Module`` container;
* a ``torch.nn`` leaf module (``Linear``, ``BatchNorm2d``, ...) of a class from the fixed table
  of :mod:`fxckpt.export.targets`, made without calling its ``__init__`` and given back its
  saved attributes (data only; a function-valued one such as ``activation`` from the table);
* a ``torch.fx.GraphModule`` whose graph is rebuilt node by node from its program file
  (:mod:`fxckpt.export.program`) once the whole tree is in place;
* a no-op standing for ``torch.export``'s input guards.

Tensors are put in place by key, so every slot that held one Parameter holds it again; the
slots are kept so that ``.to()`` can put the converted tensors back (see ``LoadedModule``).
"""

from __future__ import annotations

import json
from typing import Any, Optional

import torch
import torch.fx

from fxckpt.export.codec import decode, load_spec
from fxckpt.export.files import Verified
from fxckpt.export.program import build_graph, check_part, install
from fxckpt.errors import ExportError
from fxckpt.export.targets import resolve_module_class
from fxckpt.runtime.segment import SegmentModule

__all__ = ["Slot", "build_tree", "check_name", "put"]

Slot = tuple[torch.nn.Module, str, str, str]
"""``(module, "param" | "buffer" | "attr", name, key)``: where a tensor of the export lives."""

_MODULE_KEYS = frozenset(torch.nn.Module().__dict__) | {"forward"}
_LEGACY_SEGMENT_ATTRS = {"_fxckpt_name": "name", "_fxckpt_restores": "restores"}
"""Exports saved before segments had typed fields held them as graph attributes of these names."""


class _NoOp(torch.nn.Module):
    """Stands for ``torch.export``'s input guards: the loaded module checks input signatures."""

    def forward(self, *args: Any) -> None:
        return None


def check_name(name: Any, where: str) -> str:
    """A dotted module/tensor name of the export, checked part by part (see ``check_part``)."""
    if not (isinstance(name, str) and all(check_part(p) for p in name.split("."))):
        raise ExportError(f"{where}: {str(name)[:80]!r} is not a name an export may use")
    return name


def build_tree(entries: list[dict[str, Any]], store: Verified, tensors: dict[str, torch.Tensor],
               training: bool) -> tuple[torch.nn.Module, list[Slot]]:
    """The root module of one variant, and every tensor slot in it."""
    modules: dict[str, torch.nn.Module] = {}
    graphs: list[tuple[torch.fx.GraphModule, dict[str, Any]]] = []
    slots: list[Slot] = []
    for e in entries:
        path = e["path"]
        if path:
            check_name(path, "structure.json: a module path")
        if "same_as" in e:
            mod = modules[e["same_as"]]
        else:
            parent = modules.get(path.rpartition(".")[0]) if path else None
            mod = _make(e, inside_leaf=_is_leaf(parent))
            slots += _link(mod, e, tensors)
            if e["kind"] == "leaf" and hasattr(mod, "_init_flat_weights"):
                _init_flat_weights(mod, e)  # RNNs keep a list of their parameters
            if e["kind"] == "graph":
                graphs.append((mod, e))  # type: ignore[arg-type]
            mod.training = training
        modules[path] = mod
        if path:
            parent, _, name = path.rpartition(".")
            modules[parent]._modules[name] = mod
    for gm, e in graphs:
        _give_graph(gm, e, store)
    return modules[""], slots


def _is_leaf(mod: Optional[torch.nn.Module]) -> bool:
    """A rebuilt torch.nn module (not a container of the graph's tree, not a graph)."""
    return mod is not None and type(mod) not in (torch.nn.Module, _NoOp) \
        and not isinstance(mod, torch.fx.GraphModule)


def _make(e: dict[str, Any], inside_leaf: bool = False) -> torch.nn.Module:
    """A module from its entry. A torch.nn container (``ModuleList``) is rebuilt only inside a
    leaf module, whose own forward uses it (``TransformerEncoder.layers``): never as a leaf a
    graph can reach."""
    kind = e["kind"]
    where = f"the module at {e['path'] or '<root>'}"
    if kind == "container":
        return torch.nn.Module()
    if kind == "noop":
        return _NoOp()
    if kind == "leaf":
        cls: Any = resolve_module_class(e["cls"], where, inside_leaf=inside_leaf)
        mod = cls.__new__(cls)
        torch.nn.Module.__init__(mod)
        for name, value in e["attrs"].items():
            _check_attribute_name(cls, name, where)
            try:
                mod.__dict__[name] = decode(value)
            except ExportError as err:
                raise ExportError(f"{where}, attribute {name!r}: {err}") from None
        return mod
    if kind == "graph":
        name = e.get("class_name", "GraphModule")
        if not (isinstance(name, str) and name.isidentifier()):
            raise ExportError(f"{where}: {str(name)[:80]!r} is not a class name")
        fields = _segment_fields(e)
        if fields is not None:
            return SegmentModule(torch.nn.Module(), torch.fx.Graph(), **fields)
        return torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph(), name)
    raise ExportError(f"unknown module kind {str(kind)[:40]!r} of {where} in the export")


def _check_attribute_name(cls: type, name: Any, where: str) -> None:
    """A leaf module's saved attribute may be instance data only: never a name its class or a
    base defines (a method such as ``_call_impl`` or ``forward``, a property, a descriptor, a
    class default such as ``_compiled_call_impl``), which ``nn.Module.__call__`` and the forward
    would read from the instance instead. No ``torch.nn`` module's own data shadows one."""
    if not check_part(name) or name in _MODULE_KEYS or any(
            name in vars(klass) for klass in cls.__mro__):
        raise ExportError(f"{where}: the attribute name {str(name)[:80]!r} is not one an export "
                          f"may set on a {cls.__name__} (its class defines it, or it is "
                          "nn.Module's own)")


def _give_graph(gm: torch.fx.GraphModule, e: dict[str, Any], store: Verified) -> None:
    """Set a graph module's attributes and specs, then its graph (torch.fx compiles it)."""
    where = e["program"]
    for name, text in e["specs"].items():
        if not check_part(name) or name in _MODULE_KEYS or hasattr(type(gm), name):
            raise ExportError(f"{where}: the spec name {str(name)[:80]!r} is not one an export "
                              "may set")
        gm.__dict__[name] = load_spec(text, f"{where} {name}")
    try:
        program = json.loads(store.read_text(where))
    except (ValueError, RecursionError) as err:
        raise ExportError(f"{where} in export {store.root} is not valid JSON: "
                          f"{type(err).__name__}: {str(err)[:100]}") from None
    if not isinstance(program, dict):
        raise ExportError(f"{where} in export {store.root} is not a graph program")
    graph, info = build_graph(program, where)
    install(gm, graph, info, where)


def _segment_fields(e: dict[str, Any]) -> Optional[dict[str, Any]]:
    """A segment's keyword arguments (``name``, ``restores``, ``kept``, ``early_stop``,
    ``draws``) if the graph entry is a lowered segment, else None."""
    where = e.get("program")
    attrs = e.get("attrs", {})
    for key in attrs:
        if key not in _LEGACY_SEGMENT_ATTRS:
            raise ExportError(f"{where}: a graph module has no saved attribute {str(key)[:80]!r}")
    fields = e.get("segment")
    if fields is None and attrs:
        fields = {_LEGACY_SEGMENT_ATTRS[k]: decode(v) for k, v in attrs.items()}
    if fields is None:
        return None
    name = fields.get("name") if isinstance(fields, dict) else None
    restores = fields.get("restores", ()) if isinstance(fields, dict) else None
    if not isinstance(name, str) or not isinstance(restores, (list, tuple)):
        raise ExportError(f"{where}: a segment needs a name and a list of buffers to restore "
                          f"(got {str(fields)[:80]})")
    flags = {flag: fields.get(flag, True) for flag in ("early_stop", "draws")}
    for flag, value in flags.items():
        if not isinstance(value, bool):
            raise ExportError(f"{where}: a segment's {flag} must be true or false "
                              f"(got {str(value)[:80]})")
    return dict(name=name,
                restores=tuple(check_name(n, f"{where}: a buffer to restore") for n in restores),
                kept=_kept(fields.get("kept", 0), str(where)), **flags)


def _init_flat_weights(mod: torch.nn.Module, e: dict[str, Any]) -> None:
    """An RNN's list of its parameters, named by ``_flat_weights_names`` from the file: each
    name must be one of the module's own parameters (``getattr`` reads them)."""
    names = mod.__dict__.get("_flat_weights_names")
    if not (isinstance(names, list)
            and all(isinstance(n, str) and n in mod._parameters for n in names)):
        raise ExportError(f"the module at {e['path'] or '<root>'}: _flat_weights_names must name "
                          f"its own parameters (got {str(names)[:80]})")
    getattr(mod, "_init_flat_weights")()


def _kept(value: Any, where: str) -> int:
    """How many nodes a segment keeps (selective recompute)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ExportError(f"{where}: a segment's kept count must be an int >= 0 "
                          f"(got {str(value)[:80]})")
    return value


def _link(mod: torch.nn.Module, e: dict[str, Any], tensors: dict[str, torch.Tensor]) -> list[Slot]:
    slots: list[Slot] = []
    where = f"the module at {e['path'] or '<root>'}"
    names = [*e["params"], *e["buffers"], *e["tensors"]]
    for name in names:  # never a name the class defines (a tensor as `_call_impl`)
        if (not check_part(name) or name in _MODULE_KEYS or hasattr(type(mod), name)
                or name in mod.__dict__):
            raise ExportError(f"{where}: {str(name)[:80]!r} is not a tensor name an export may "
                              "use")
    for name, key in e["params"].items():
        mod._parameters[name] = None if key is None else _get(tensors, key, e)
        if key is not None:
            slots.append((mod, "param", name, key))
    for name, (key, persistent) in e["buffers"].items():
        mod._buffers[name] = None if key is None else _get(tensors, key, e)
        if not persistent:
            mod._non_persistent_buffers_set.add(name)
        if key is not None:
            slots.append((mod, "buffer", name, key))
    for name, key in e["tensors"].items():
        mod.__dict__[name] = _get(tensors, key, e)
        slots.append((mod, "attr", name, key))
    return slots


def _get(tensors: dict[str, torch.Tensor], key: str, e: dict[str, Any]) -> Any:
    try:
        return tensors[key]
    except (KeyError, TypeError):
        raise ExportError(f"the export's weights have no tensor {str(key)[:80]!r} (used at "
                          f"{e['path'] or '<root>'})") from None


def put(slot: Slot, value: torch.Tensor) -> None:
    """Put ``value`` into ``slot`` (after ``.to()`` replaced the tensors)."""
    mod, kind, name, _ = slot
    if kind == "param":
        mod._parameters[name] = value  # type: ignore[assignment]
    elif kind == "buffer":
        mod._buffers[name] = value
    else:
        mod.__dict__[name] = value
