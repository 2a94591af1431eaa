"""Plain values and pytree specs as JSON data, decoded without importing or calling anything.

An export must run without the model's code, and loading it must run no code from the export.
So nothing is pickled and nothing is named by an importable path: values are tagged JSON
(``{"__dtype__": "float32"}``, ``{"__node__": "linear"}``), and whatever a tag names is looked
up in a fixed table (:mod:`fxckpt.export.targets`): dtypes, memory formats and layouts by
name, functions (``TransformerEncoderLayer.activation = F.relu``) by their table name.

Pytree specs (a graph's input and output structure, Hugging Face ``ModelOutput`` types) use
torch's JSON format, but are checked before torch reads them: torch's reader imports modules
named in the data (``defaultdict`` factories, enum classes), so only the container types torch
registers itself and ``transformers`` output classes are accepted, and no context may hold a
JSON object.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Mapping, Optional

import torch
import torch.fx
import torch.utils._pytree as pytree

from fxckpt.errors import ExportError, Unencodable  # re-exported: tests name them here
from fxckpt.export.targets import (DTYPES, LAYOUTS, MEMORY_FORMATS, holds_function, lookup,
                                  table_name)
from fxckpt import integrations

__all__ = ["ExportError", "Unencodable", "encode", "decode", "dump_spec", "load_spec"]

_SPEC_TYPES = frozenset({
    "builtins.tuple", "builtins.list", "builtins.dict", "collections.namedtuple",
    "collections.OrderedDict", "collections.deque", "torch.Size",
    "torch.fx.immutable_collections.immutable_list",
    "torch.fx.immutable_collections.immutable_dict",
})
"""Pytree node types an export may use besides Hugging Face outputs (not ``defaultdict``: torch
reads its factory by importing a module the data names)."""


NodeNamer = Callable[[torch.fx.Node], str]


def encode(value: Any, where: str, nodes: Optional[NodeNamer] = None) -> Any:
    """``value`` as JSON-ready data. ``nodes`` names graph nodes (node arguments only)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, torch.fx.Node) and nodes is not None:
        return {"__node__": nodes(value)}
    tagged = _encode_tagged(value, where, nodes)
    if tagged is not None:
        return tagged
    if callable(value) and nodes is None:
        raise Unencodable(holds_function(
            where, f"{value!r:.80}", ", which is not one of the functions an export can name "
            "(torch tensor functions, operator.*, fxckpt runtime functions); use a torch "
            "function (F.gelu) or a torch.nn module (nn.GELU(approximate='tanh')) in its place"))
    raise Unencodable(f"{where} holds a {type(value).__name__} ({value!r:.80}), which an export "
                      "cannot store")


def _encode_tagged(value: Any, where: str, nodes: Optional[NodeNamer]) -> Any:
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"__device__": str(value)}
    if isinstance(value, torch.memory_format):
        return {"__memory_format__": str(value).removeprefix("torch.")}
    if isinstance(value, torch.layout):
        return {"__layout__": str(value).removeprefix("torch.")}
    if value is Ellipsis:
        return {"__ellipsis__": None}
    if isinstance(value, slice):
        parts = (value.start, value.stop, value.step)
        return {"__slice__": [encode(v, where, nodes) for v in parts]}
    if isinstance(value, torch.Size):
        return {"__size__": [encode(v, where, nodes) for v in value]}
    if type(value) is tuple:  # not a namedtuple: its class would have to be named
        return {"__tuple__": [encode(v, where, nodes) for v in value]}
    if isinstance(value, list):
        return [encode(v, where, nodes) for v in value]
    if isinstance(value, (set, frozenset)) and nodes is None:
        return {"__set__": [encode(v, where, nodes) for v in sorted(value, key=repr)]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"__dict__": {k: encode(v, f"{where}[{k!r}]", nodes) for k, v in value.items()}}
    if callable(value) and nodes is None and table_name(value) is not None:
        return {"__function__": table_name(value)}
    return None


def decode(data: Any, nodes: Optional[Mapping[str, torch.fx.Node]] = None) -> Any:
    """The inverse of :func:`encode`; ``nodes`` resolves node references (graph arguments)."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode(v, nodes) for v in data]
    if not (isinstance(data, dict) and len(data) == 1):
        raise ExportError(f"the export holds a value that is not tagged data ({str(data)[:80]})")
    (tag, inner), = data.items()
    decoder = _DECODERS.get(tag)
    if decoder is None or (tag in _LOOSE_ONLY and nodes is not None):
        raise ExportError(f"unknown tagged value {str(tag)[:40]!r} in the export")
    return decoder(inner, nodes)


def _items(inner: Any, nodes: Optional[Mapping[str, torch.fx.Node]]) -> list[Any]:
    if not isinstance(inner, list):
        raise ExportError(f"the export holds a malformed sequence ({str(inner)[:80]})")
    return [decode(v, nodes) for v in inner]


def _node(inner: Any, nodes: Optional[Mapping[str, torch.fx.Node]]) -> torch.fx.Node:
    if nodes is None or not isinstance(inner, str) or inner not in nodes:
        raise ExportError(f"the export refers to node {str(inner)[:80]!r} before (or without) "
                          "defining it")
    return nodes[inner]


def _slice(inner: Any, nodes: Optional[Mapping[str, torch.fx.Node]]) -> slice:
    parts = _items(inner, nodes)
    if len(parts) != 3:
        raise ExportError("the export holds a malformed slice")
    return slice(*parts)


def _dict(inner: Any, nodes: Optional[Mapping[str, torch.fx.Node]]) -> dict[str, Any]:
    if not isinstance(inner, dict):
        raise ExportError(f"the export holds a malformed mapping ({str(inner)[:80]})")
    return {k: decode(v, nodes) for k, v in inner.items()}


def _float(inner: Any, nodes: Any) -> float:
    if inner not in ("inf", "-inf", "nan"):
        raise ExportError(f"the export holds a malformed float {str(inner)[:20]!r}")
    return float(inner)


def _device(inner: Any, nodes: Any) -> torch.device:
    if not isinstance(inner, str):
        raise ExportError("the export holds a malformed device")
    try:
        return torch.device(inner)
    except RuntimeError as e:
        raise ExportError(f"the export names an invalid device {inner[:40]!r}: {e}") from None


def _function(inner: Any, nodes: Any) -> Any:
    from fxckpt.export.targets import resolve_attribute_function

    return resolve_attribute_function(inner, "an attribute of a saved module")


_DECODERS: dict[str, Callable[[Any, Any], Any]] = {
    "__node__": _node,
    "__tuple__": lambda inner, nodes: tuple(_items(inner, nodes)),
    "__set__": lambda inner, nodes: set(_items(inner, nodes)),
    "__dict__": _dict,
    "__slice__": _slice,
    "__size__": lambda inner, nodes: torch.Size(_items(inner, nodes)),
    "__ellipsis__": lambda inner, nodes: Ellipsis,
    "__float__": _float,
    "__dtype__": lambda inner, nodes: lookup(DTYPES, inner, "dtype"),
    "__memory_format__": lambda inner, nodes: lookup(MEMORY_FORMATS, inner, "memory format"),
    "__layout__": lambda inner, nodes: lookup(LAYOUTS, inner, "layout"),
    "__device__": _device,
    "__function__": _function,
}
_LOOSE_ONLY = frozenset({"__set__", "__function__"})
"""Tags of module attributes that a graph's arguments never hold (fx cannot print them)."""


def dump_spec(spec: Any, where: str) -> str:
    """A pytree ``TreeSpec`` as JSON (its node types must be ones :func:`load_spec` accepts)."""
    try:
        text = pytree.treespec_dumps(spec)
    except Exception as e:
        raise ExportError(f"{where}: its pytree structure cannot be written ({e})") from e
    _type_names(json.loads(text)[1], where)
    return text


def load_spec(text: str, where: str) -> Any:
    """The inverse of :func:`dump_spec`, after checking every node type and context as data."""
    try:
        protocol, schema = json.loads(text)
    except (TypeError, ValueError):
        raise _invalid_spec(where) from None
    if protocol != 1:
        raise ExportError(f"{where}: unknown pytree format {str(protocol)[:20]!r}")
    for type_name in _type_names(schema, where):
        if integrations.output_class(type_name, pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE) is False:
            raise ExportError(f"{where}: {type_name} is not a transformers ModelOutput class")
    try:
        return pytree.treespec_loads(text)
    except Exception as e:
        raise _invalid_spec(where, f" ({type(e).__name__}: {e})") from None


def _invalid_spec(where: str, why: str = "") -> ExportError:
    return ExportError(f"{where}: the pytree structure is not valid{why}")


def _check_type(type_name: str, where: str) -> None:
    if type_name not in _SPEC_TYPES and not integrations.names_output_type(type_name):
        raise ExportError(
            f"{where} uses the pytree node type {type_name[:120]!r}; an export holds only tuples, "
            "lists, dicts, OrderedDicts, deques, torch.Size, registered namedtuples and "
            "transformers ModelOutputs")


def _type_names(schema: Any, where: str) -> list[str]:
    """Every node type of a spec's JSON schema, each checked; no context may hold a JSON object."""
    if not (isinstance(schema, dict) and isinstance(schema.get("children_spec"), list)):
        raise _invalid_spec(where)
    found: list[str] = []
    if schema.get("type") is not None:
        if not (isinstance(schema["type"], str) and isinstance(schema.get("context"), str)):
            raise _invalid_spec(where)
        _check_type(schema["type"], where)
        json.loads(schema["context"], object_hook=_no_objects(where))
        found.append(schema["type"])
    for child in schema["children_spec"]:
        found += _type_names(child, where)
    return found


def _no_objects(where: str) -> Callable[[dict], Any]:
    def refuse(obj: dict) -> Any:
        raise ExportError(f"{where}: a pytree context holds a JSON object ({str(obj)[:80]}), "
                          "which torch would read by importing the module it names")

    return refuse
