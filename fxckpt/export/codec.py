"""Plain values, global names and pytree specs as JSON, with the libraries load may import.

An export must run without the model's code, and loading it must never run code from anywhere
but the export itself. So nothing is pickled: module attributes are written as tagged JSON
values, the names generated code refers to (``torch``, ``fxckpt_checkpoint``, ``getattr``) are
written as ``module`` + ``name`` and resolved by import on load, and only from the packages in
:data:`ALLOWED_PACKAGES`. A graph that calls a function of the user's own package cannot be
exported, and :func:`describe_global` says which one.
"""

from __future__ import annotations

import importlib
import json
import types
from typing import Any

import torch
import torch.utils._pytree as pytree

from fxckpt.errors import FxckptError

__all__ = [
    "ALLOWED_PACKAGES", "ExportError", "encode", "decode", "describe_global", "resolve_global",
    "resolve_class", "class_path", "dump_spec", "load_spec", "Unencodable",
]

ALLOWED_PACKAGES = frozenset({"torch", "fxckpt", "builtins", "math", "operator", "typing", "collections",
                              "transformers"})
"""Top-level packages an export may name (for functions, classes and pytree node types)."""


class ExportError(FxckptError, RuntimeError):
    """A module cannot be saved, or a directory is not a valid, intact fxckpt export."""


class Unencodable(ExportError, TypeError):
    """A value has no JSON form (the message names where it was found)."""


def encode(value: Any, where: str) -> Any:
    """``value`` as JSON-ready data; tuples, sets, dtypes, devices and sizes are tagged."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"__device__": str(value)}
    if isinstance(value, torch.Size):
        return {"__size__": list(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, where) for v in value]}
    if isinstance(value, list):
        return [encode(v, where) for v in value]
    if isinstance(value, (set, frozenset)):
        return {"__set__": [encode(v, where) for v in sorted(value, key=repr)]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"__dict__": {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}}
    raise Unencodable(f"{where} holds a {type(value).__name__} ({value!r:.80}), which an export cannot store")


def decode(data: Any) -> Any:
    """The inverse of :func:`encode`."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    (tag, inner), = data.items()
    if tag == "__dtype__":
        return getattr(torch, inner)
    if tag == "__device__":
        return torch.device(inner)
    if tag == "__size__":
        return torch.Size(inner)
    if tag == "__tuple__":
        return tuple(decode(v) for v in inner)
    if tag == "__set__":
        return {decode(v) for v in inner}
    if tag == "__dict__":
        return {k: decode(v) for k, v in inner.items()}
    raise ExportError(f"unknown tagged value {tag!r} in the export's structure")


def _check_package(module: str, what: str) -> None:
    if module.split(".")[0] not in ALLOWED_PACKAGES:
        raise ExportError(
            f"{what} comes from {module!r}, which is not one of {sorted(ALLOWED_PACKAGES)}: a loaded export "
            "could not run it without the model's own code. Keep such code inside modules that torch.fx "
            "traces through, or use torch ops"
        )


def describe_global(name: str, obj: Any) -> dict[str, str]:
    """How generated code's global ``name`` is found again on load."""
    from torch.fx.graph import _custom_builtins
    from torch.package import sys_importer

    if name in _custom_builtins:
        return {"builtin": name}
    if isinstance(obj, types.ModuleType):
        _check_package(obj.__name__, f"the generated code's global {name!r}")
        return {"module": obj.__name__}
    try:
        module, qualname = sys_importer.get_name(obj)
    except Exception as e:
        raise ExportError(f"the generated code's global {name!r} ({obj!r:.80}) cannot be named for import: {e}") from e
    _check_package(module, f"the generated code's global {name!r} ({module}.{qualname})")
    spec = {"from": module, "name": qualname}
    if resolve_global(spec) is not obj:
        raise ExportError(f"the generated code's global {name!r} is not {module}.{qualname} when imported")
    return spec


def resolve_global(spec: dict[str, str]) -> Any:
    """The object a :func:`describe_global` spec names (importing only allowed packages)."""
    from torch.fx.graph import _custom_builtins

    if "builtin" in spec:
        if spec["builtin"] not in _custom_builtins:
            raise ExportError(f"the export names an unknown fx builtin {spec['builtin']!r}")
        return _custom_builtins[spec["builtin"]].obj
    module = spec.get("module") or spec.get("from") or ""
    _check_package(module, "a name the export's code uses")
    obj: Any = importlib.import_module(module)
    for part in spec.get("name", "").split(".") if "from" in spec else ():
        obj = getattr(obj, part)
    return obj


def resolve_class(path: str) -> type:
    """An ``nn.Module`` subclass from ``package.module:QualName``."""
    module, _, qualname = path.partition(":")
    cls = resolve_global({"from": module, "name": qualname})
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise ExportError(f"{path} is not a torch.nn.Module class")
    return cls


def class_path(cls: type) -> str:
    """``package.module:QualName`` of an ``nn.Module`` class, checked to be loadable."""
    path = f"{cls.__module__}:{cls.__qualname__}"
    _check_package(cls.__module__, f"module class {cls.__qualname__}")
    if resolve_class(path) is not cls:
        raise ExportError(f"module class {path} is not found again by import")
    return path


def dump_spec(spec: Any, where: str) -> str:
    """A pytree ``TreeSpec`` as JSON (node types must come from allowed packages)."""
    text = pytree.treespec_dumps(spec)
    for type_name in _type_names(json.loads(text)):
        _check_package(type_name, f"{where} (pytree node type {type_name})")
    return text


def load_spec(text: str) -> Any:
    """The inverse of :func:`dump_spec`: imports the modules defining the spec's node types first."""
    for type_name in _type_names(json.loads(text)):
        module = type_name.rpartition(".")[0]
        _check_package(module or type_name, f"pytree node type {type_name}")
        if module:
            importlib.import_module(module)
    return pytree.treespec_loads(text)


def _type_names(data: Any) -> list[str]:
    found: list[str] = []
    if isinstance(data, dict):
        if isinstance(data.get("type"), str):
            found.append(data["type"])
        for v in data.values():
            found += _type_names(v)
    elif isinstance(data, list):
        for v in data:
            found += _type_names(v)
    return found
