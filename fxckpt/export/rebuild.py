"""The load side of an export: module trees rebuilt from structure, code and tensors.

Each module entry becomes one of

* a plain ``nn.Module`` container;
* a ``torch.nn`` leaf module (``Linear``, ``BatchNorm2d``, ...), made without calling its
  ``__init__`` and given back its saved attributes, so no constructor arguments are guessed;
* a :class:`CodeModule`: a module whose ``forward`` is the generated code read from the export
  (the rewritten graph, or a ``segment_N`` run through ``fxckpt.checkpoint``);
* a no-op standing for ``torch.export``'s input guards.

Tensors are put in place by key, so every slot that held one Parameter holds it again; the
slots are kept so that ``.to()`` can put the converted tensors back (see ``LoadedModule``).
"""

from __future__ import annotations

from typing import Any

import torch

from fxckpt.export.codec import ExportError, decode, load_spec, resolve_class, resolve_global
from fxckpt.export.files import Verified

__all__ = ["CodeModule", "Slot", "build_tree"]

Slot = tuple[torch.nn.Module, str, str, str]
"""``(module, "param" | "buffer" | "attr", name, key)``: where a tensor of the export lives."""


class CodeModule(torch.nn.Module):
    """A module running generated code from an export; ``.code`` is that code."""

    code: str = ""

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # replaced per instance class
        raise NotImplementedError


class _NoOp(torch.nn.Module):
    """Stands for ``torch.export``'s input guards: the loaded module checks input signatures."""

    def forward(self, *args: Any) -> None:
        return None


def build_tree(entries: list[dict[str, Any]], store: Verified, tensors: dict[str, torch.Tensor],
               training: bool) -> tuple[torch.nn.Module, list[Slot]]:
    """The root module of one variant, and every tensor slot in it."""
    modules: dict[str, torch.nn.Module] = {}
    slots: list[Slot] = []
    for e in entries:
        path = e["path"]
        if "same_as" in e:
            mod = modules[e["same_as"]]
        else:
            mod = _make(e, store)
            slots += _link(mod, e, tensors)
            if e["kind"] == "leaf" and hasattr(mod, "_init_flat_weights"):
                getattr(mod, "_init_flat_weights")()  # RNNs keep a list of their parameters beside them
            mod.training = training
        modules[path] = mod
        if path:
            parent, _, name = path.rpartition(".")
            modules[parent]._modules[name] = mod
    return modules[""], slots


def _make(e: dict[str, Any], store: Verified) -> torch.nn.Module:
    kind = e["kind"]
    if kind == "container":
        return torch.nn.Module()
    if kind == "noop":
        return _NoOp()
    if kind == "leaf":
        cls: Any = resolve_class(e["cls"])
        mod = cls.__new__(cls)
        torch.nn.Module.__init__(mod)
        mod.__dict__.update({k: decode(v) for k, v in e["attrs"].items()})
        return mod
    if kind == "graph":
        return _code_module(e, store)
    raise ExportError(f"unknown module kind {kind!r} at {e['path'] or '<root>'} in the export's structure")


def _code_module(e: dict[str, Any], store: Verified) -> CodeModule:
    src = store.read_text(e["code"])
    scope = {name: resolve_global(spec) for name, spec in e["globals"].items()}
    try:
        exec(compile(src, str(store.root / e["code"]), "exec", dont_inherit=True), scope)
    except SyntaxError as err:
        raise ExportError(f"{e['code']} in export {store.root} is not valid Python: {err}") from err
    forward = scope.get("forward")
    if not callable(forward):
        raise ExportError(f"{e['code']} in export {store.root} defines no forward")
    cls = type(e.get("class_name") or "CodeModule", (CodeModule,), {"forward": forward, "code": src})
    mod = cls()
    for name, value in e["attrs"].items():
        setattr(mod, name, decode(value))
    for name, text in e["specs"].items():
        setattr(mod, name, load_spec(text))
    return mod


def _link(mod: torch.nn.Module, e: dict[str, Any], tensors: dict[str, torch.Tensor]) -> list[Slot]:
    slots: list[Slot] = []
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
    except KeyError:
        raise ExportError(f"the export's weights have no tensor {key!r} (used at {e['path'] or '<root>'})") from None


def put(slot: Slot, value: torch.Tensor) -> None:
    """Put ``value`` into ``slot`` (after ``.to()`` replaced the tensors)."""
    mod, kind, name, _ = slot
    if kind == "param":
        mod._parameters[name] = value  # type: ignore[assignment]
    elif kind == "buffer":
        mod._buffers[name] = value
    else:
        mod.__dict__[name] = value
