"""What a loaded export may call or build: an explicit table, never a path walked by name.

Loading must run no code that the export supplies, so an export never names a Python object
by an importable path: such a path reaches whatever the named module imports
(``serialization.os.system`` under ``torch`` is ``os.system``). Every object a rebuilt graph or
module refers to comes from a table built here from torch's and fxckpt's own namespaces, and is
found by its exact name:

* functions (``call_function`` targets, and function-valued attributes such as
  ``TransformerEncoderLayer.activation``): the tensor functions torch.fx records, which are
  exactly those torch lets ``__torch_function__`` override (``torch.relu``,
  ``torch.nn.functional.gelu``, ``torch.Tensor.add``, ...); ``operator`` and a few ``math``
  functions; the asserts, pytree helpers and grad-mode / autocast wrappers that traced and
  exported graphs contain; fxckpt's runtime functions (``fxckpt.checkpoint``);
* ATen operators ``torch.ops.aten.NAME.OVERLOAD``, checked against the dispatcher's schemas;
  operators that read or write files, and the families that skip validation or point tensors
  at other memory (:func:`unchecked`), are refused, and so are those functions and methods;
* ``call_method`` names (public Tensor methods, minus those that register hooks or take a
  Python callable) and ``getattr`` names (Tensor properties such as ``shape`` and ``dtype``);
* leaf module classes: the public classes of ``torch.nn.modules``, by ``module:QualName``.

A graph that needs anything else (the user's ``torch.fx.wrap``-ed function, a custom autograd
Function) cannot be exported, and :func:`function_name` says which node needs what.
"""

from __future__ import annotations

import functools
import math
import operator
import re
import types
from typing import Any, Callable, Optional

import torch

from fxckpt.errors import ExportError
from fxckpt.export.allowlist import (CHECKED, PROPERTIES, UNCHECKED_WHY, permits, refusal,
                                     unchecked)

__all__ = [
    "function_name", "table_name", "resolve_function", "METHODS", "GETATTR_NAMES",
    "resolve_attribute_function",
    "module_class_path", "resolve_module_class", "DTYPES", "MEMORY_FORMATS", "LAYOUTS",
]


_OPERATOR = (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "neg", "pos", "invert",
    "abs", "and_", "or_", "xor", "lshift", "rshift", "not_", "truth", "eq", "ne", "lt", "le", "gt",
    "ge", "is_", "is_not", "contains", "getitem", "setitem", "delitem", "concat", "index", "iadd",
    "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul", "iand", "ior", "ixor",
    "ilshift", "irshift",
)
_MATH = ("ceil", "floor", "trunc", "sqrt", "exp", "log", "log2", "log10", "sin", "cos", "tan",
         "tanh", "isfinite", "isinf", "isnan", "fabs")
_TORCH_NAMESPACES = ("torch", "torch.nn.functional", "torch.linalg", "torch.fft", "torch.special")
_NO_METHODS = frozenset({
    "apply_", "map_", "map2_",  # take a Python callable
    "register_hook", "register_post_accumulate_grad_hook", "retain_grad",  # hooks
    "backward", "module_load",
})
"""Public Tensor methods a loaded graph may not call (an export's graph is data, not a program
that registers hooks or calls back into Python)."""
_NO_FUNCTIONS = frozenset({"torch.Tensor." + name for name in _NO_METHODS})

_SYM = ("sym_int", "sym_float", "sym_max", "sym_min", "sym_not", "sym_ite", "sym_sum", "sym_sqrt")
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_ATEN = re.compile(rf"torch\.ops\.aten\.({_NAME})\.({_NAME})")
_FILE_ARGS = frozenset({"filename", "path", "file"})


@functools.cache
def _tensor_overridables() -> tuple[frozenset[int], dict[str, Any]]:
    """Ids of every overridable torch function, and the Tensor's overridable members by name."""
    from torch.overrides import get_overridable_functions

    found = get_overridable_functions()
    ids = {id(f) for fs in found.values() for f in fs}
    members: dict[str, Any] = {}
    for name in dir(torch.Tensor):
        member = getattr(torch.Tensor, name, None)
        if not name.startswith("_") and id(member) in ids:
            members[name] = member
    return frozenset(ids), members


def _runtime_functions() -> dict[str, Any]:
    """Asserts, pytree helpers and wrappers that traced and exported graphs call; fxckpt's own."""
    import torch.fx._pytree as fx_pytree
    import torch.utils._pytree as pytree
    from torch.amp import autocast_mode
    from torch.fx._symbolic_trace import _assert_is_none

    from fxckpt.runtime.attention import attention, layer_mask, sized_mask
    from fxckpt.runtime.checkpoint import checkpoint
    from fxckpt.runtime.nn_masks import canonical_mask, causal_hint, check_transformer_inputs
    from fxckpt.runtime.offload import offload_region
    from fxckpt.runtime.selective import keep_begin, keep_end

    higher_order = torch.ops.higher_order
    return {
        "fxckpt.attention": attention,
        "fxckpt.layer_mask": layer_mask,
        "fxckpt.sized_mask": sized_mask,
        "fxckpt.checkpoint": checkpoint,
        "fxckpt.canonical_mask": canonical_mask,
        "fxckpt.causal_hint": causal_hint,
        "fxckpt.check_transformer_inputs": check_transformer_inputs,
        "fxckpt.keep_begin": keep_begin,
        "fxckpt.keep_end": keep_end,
        "fxckpt.runtime.offload.offload_region": offload_region,
        "torch._assert": torch._assert,
        "torch._check": torch._check,
        "torch._check_is_size": torch._check_is_size,
        "torch.fx._symbolic_trace._assert_is_none": _assert_is_none,
        "torch.fx._pytree.tree_flatten_spec": fx_pytree.tree_flatten_spec,
        "torch.utils._pytree.tree_flatten": pytree.tree_flatten,
        "torch.utils._pytree.tree_unflatten": pytree.tree_unflatten,
        "torch.utils._pytree.tree_leaves": pytree.tree_leaves,
        "torch._C._set_grad_enabled": torch._C._set_grad_enabled,
        "torch.amp.autocast_mode._enter_autocast": autocast_mode._enter_autocast,
        "torch.amp.autocast_mode._exit_autocast": autocast_mode._exit_autocast,
        "torch.ops.higher_order.wrap_with_set_grad_enabled":
            higher_order.wrap_with_set_grad_enabled,
        "torch.ops.higher_order.wrap_with_autocast": higher_order.wrap_with_autocast,
        **{f"torch.{name}": getattr(torch, name) for name in _SYM if hasattr(torch, name)},
    }


@functools.cache
def _functions() -> tuple[dict[str, Any], dict[int, str]]:
    """The table: qualified name -> object, and object id -> its (first) qualified name."""
    ids, members = _tensor_overridables()
    table: dict[str, Any] = {f"operator.{n}": getattr(operator, n) for n in _OPERATOR}
    table.update({f"math.{n}": getattr(math, n) for n in _MATH})
    table["builtins.getattr"] = getattr
    table.update(_runtime_functions())
    for name, obj in _namespace_functions().items():
        table.setdefault(name, obj)
    for name, member in members.items():
        if callable(member) and f"torch.Tensor.{name}" not in _NO_FUNCTIONS:
            table[f"torch.Tensor.{name}"] = member
    for name in [n for n in table if unchecked(n.rpartition(".")[2])]:
        del table[name]
    names: dict[int, str] = {}
    for name, obj in table.items():
        names.setdefault(id(obj), name)
    return table, names


@functools.cache
def _namespace_functions() -> dict[str, Any]:
    """The tensor functions of torch's namespaces (``torch.relu``, ``torch.nn.functional.gelu``):
    what a module attribute holding a function (``TransformerEncoderLayer.activation``) may be."""
    ids, _ = _tensor_overridables()
    found: dict[str, Any] = {}
    for namespace in _TORCH_NAMESPACES:
        for name, obj in vars(_torch_module(namespace)).items():  # vars: no lazy submodule imports
            if not name.startswith("_") and id(obj) in ids and not unchecked(name):
                found.setdefault(f"{namespace}.{name}", obj)
    return found


def holds_function(where: str, shown: str, why: str) -> str:
    """The refusal of a function (``shown``) a saved value holds, saving or loading it: ``why``
    (``", which ..."``)."""
    return f"{where} holds the function {shown}{why}"


def resolve_attribute_function(name: str, where: str) -> Callable[..., Any]:
    """A function a saved module attribute holds: a tensor function of torch's namespaces only
    (never ``getattr``, ``operator.*`` or fxckpt's runtime functions, which a module could call
    with arguments of its own choosing: ``_call_impl = getattr`` walked to ``exec`` once), and
    on the allowlist."""
    found = _namespace_functions().get(name) if isinstance(name, str) else None
    if found is not None and not permits("attribute_functions", name):
        raise ExportError(holds_function(where, f"{name[:80]!r}", ", which is not on fxckpt's "
                                         "allowlist of what a loaded export may use"
                                         + _ALLOW_HINT))
    if found is None:
        raise ExportError(holds_function(where, f"{str(name)[:80]!r}", "; a saved module's "
                                         "attribute may hold a torch tensor function only "
                                         "(torch.*, torch.nn.functional.*)"))
    return found  # type: ignore[no-any-return]


def _torch_module(namespace: str) -> types.ModuleType:
    import torch.nn.functional

    return {"torch": torch, "torch.nn.functional": torch.nn.functional,
            "torch.linalg": torch.linalg, "torch.fft": torch.fft,
            "torch.special": torch.special}[namespace]


def _qualified(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"torch.ops.{target.namespace}.{target._opname}.{target._overloadname}"
    module = getattr(target, "__module__", None) or type(target).__module__
    return f"{module}.{getattr(target, '__qualname__', getattr(target, '__name__', repr(target)))}"


def table_name(obj: Any) -> Optional[str]:
    """The table name of a function, or ``None`` when the table does not hold it."""
    table, names = _functions()
    name = names.get(id(obj))
    return name if name is not None and table[name] is obj else None


def function_name(target: Any, where: str) -> str:
    """The table name of a graph's call target; :class:`ExportError` (naming ``where``) if none."""
    from fxckpt.capture.tracer import function_of

    if isinstance(target, torch._ops.OpOverload) and target.namespace == "aten":
        aten = _qualified(target)
        if _table_function(aten, where) is target:
            return aten
    name = table_name(target)
    if name is not None:
        return name
    fn_cls = function_of(target)
    if fn_cls is not None:
        raise ExportError(
            f"{where} calls the custom autograd Function {fn_cls.__module__}."
            f"{fn_cls.__qualname__}: its forward and backward are the model's own code, which an "
            "export does not hold. Save a model whose Functions torch.fx can trace through, or "
            "keep the model's code with the checkpoint")
    raise ExportError(
        f"{where} calls {_qualified(target)}, which is not one of the functions a loaded export "
        "may call (torch and torch.nn.functional tensor functions, Tensor methods, ATen "
        "operators, operator.*, fxckpt.checkpoint): a loaded export runs no code of its own. "
        "Functions of your own package (torch.fx.wrap) cannot be exported; use torch ops in the "
        "model instead")


_ALLOW_HINT = (" (fxckpt/export/allowlist.json: what fxckpt.save writes for the models it is "
               "tested on). If you trust this export's source, fxckpt.load(path, allow=[...]) "
               "may name it")


def resolve_function(name: str, where: str) -> Callable[..., Any]:
    """The object of a table name on the allowlist (``torch.ops.aten.NAME.OVERLOAD`` is looked up
    exactly)."""
    if not isinstance(name, str):
        raise ExportError(f"{where}: a call target must be a name, not {type(name).__name__}")
    if not permits("functions", name):
        why = refusal("functions", name)
        if why is not None:
            raise ExportError(f"{where} calls {name[:120]}, which a loaded export may never "
                              f"call: {why}")
        raise ExportError(f"{where} calls {name[:120]}, which is not on fxckpt's allowlist of "
                          f"what a loaded export may call{_ALLOW_HINT}")
    return CHECKED.get(name) or _table_function(name, where)


def _table_function(name: str, where: str) -> Callable[..., Any]:
    """The object of a name of the table (ATen overloads checked against the dispatcher)."""
    aten = _ATEN.fullmatch(name)
    if aten is not None:
        return _aten(aten.group(1), aten.group(2), where)
    table, _ = _functions()
    if name not in table:
        raise ExportError(f"{where} names {name[:120]!r}, which is not in the table of functions "
                          "a loaded export may call; the export was not written by fxckpt.save "
                          "or was edited")
    return table[name]  # type: ignore[no-any-return]


def _aten(name: str, overload: str, where: str) -> torch._ops.OpOverload:
    """``torch.ops.aten.NAME.OVERLOAD`` once the dispatcher confirms such an operator exists."""
    overload_name = "" if overload == "default" else overload
    qualified = f"aten::{name}" + (f".{overload_name}" if overload_name else "")
    try:
        torch._C._dispatch_find_schema_or_throw(f"aten::{name}", overload_name)
        op = getattr(getattr(torch.ops.aten, name), overload)
    except (RuntimeError, AttributeError):
        op = None
    schema = getattr(op, "_schema", None)
    if (not isinstance(op, torch._ops.OpOverload) or schema is None
            or (schema.name, schema.overload_name) != (f"aten::{name}", overload_name)):
        raise ExportError(f"{where} names the ATen operator {qualified}, which this torch does "
                          "not have")
    if name == "from_file" or any(a.name in _FILE_ARGS for a in schema.arguments):
        raise ExportError(f"{where} names the ATen operator {qualified}, which reads or writes "
                          "files; a loaded export may not call it")
    if unchecked(name) or any(a.name == "unsafe" for a in schema.arguments):
        raise ExportError(f"{where} names the ATen operator {qualified}, which {UNCHECKED_WHY}")
    return op


@functools.cache
def _methods_and_properties() -> tuple[frozenset[str], frozenset[str]]:
    _, members = _tensor_overridables()
    methods = {n for n, m in members.items()
               if callable(m) and n not in _NO_METHODS and not unchecked(n)}
    return frozenset(methods), PROPERTIES


class _Names:
    """A lazily built, read-only set of names (``name in METHODS``)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in _methods_and_properties()[self.index]

    def __iter__(self) -> Any:
        return iter(sorted(_methods_and_properties()[self.index]))


METHODS = _Names(0)
"""Names a ``call_method`` node may call: public Tensor methods without hooks and callbacks."""
GETATTR_NAMES = _Names(1)
"""Attribute names ``getattr`` may read in a loaded graph: Tensor properties (``shape``, ...)."""


@functools.cache
def _module_classes() -> dict[str, type]:
    """``module:QualName`` -> class, each public ``nn.Module`` class of ``torch.nn.modules``."""
    import torch.nn.modules as modules

    table: dict[str, type] = {}
    for sub in vars(modules).values():
        if not isinstance(sub, types.ModuleType) or not sub.__name__.startswith(modules.__name__):
            continue
        for name, cls in vars(sub).items():
            if (isinstance(cls, type) and issubclass(cls, torch.nn.Module)
                    and cls.__module__ == sub.__name__ and not name.startswith("_")
                    and cls is not torch.nn.Module):
                table[f"{cls.__module__}:{cls.__qualname__}"] = cls
    return table


def module_class_path(cls: type, where: str) -> str:
    """The table name of a leaf module's class; :class:`ExportError` if not a torch.nn class."""
    path = f"{cls.__module__}:{cls.__qualname__}"
    if _module_classes().get(path) is not cls:
        raise ExportError(
            f"{where} is a {cls.__module__}.{cls.__qualname__}, not one of the torch.nn module "
            "classes a loaded export can rebuild (its forward would be code the export does not "
            "hold). Let torch.fx trace through it (no hooks, no custom autograd Function "
            "inside), or keep the model's code")
    return path


def resolve_module_class(path: str, where: str, inside_leaf: bool = False) -> type:
    """A leaf module class on the allowlist; a torch.nn container only inside a leaf."""
    from fxckpt.export.allowlist import container

    cls = _module_classes().get(path) if isinstance(path, str) else None
    if cls is not None and inside_leaf and container(path):
        return cls
    if cls is not None and not permits("modules", path):
        raise ExportError(f"{where} is a {path[:120]}, which is not a leaf module class on "
                          f"fxckpt's allowlist (containers never are){_ALLOW_HINT}")
    if cls is None:
        raise ExportError(f"{where} names the module class {str(path)[:120]!r}, which is not one "
                          "of the torch.nn module classes a loaded export may rebuild")
    return cls


def _named(values: list[Any]) -> dict[str, Any]:
    return {str(v).removeprefix("torch."): v for v in values}


def _of_type(kind: type) -> list[Any]:
    return [v for v in vars(torch).values() if isinstance(v, kind)]


DTYPES: dict[str, torch.dtype] = _named(_of_type(torch.dtype))
MEMORY_FORMATS: dict[str, torch.memory_format] = _named(_of_type(torch.memory_format))
LAYOUTS: dict[str, torch.layout] = _named(_of_type(torch.layout))


def lookup(table: dict[str, Any], name: Any, what: str) -> Any:
    """``table[name]``, or an :class:`ExportError` saying the export names an unknown ``what``."""
    value: Optional[Any] = table.get(name) if isinstance(name, str) else None
    if value is None:
        raise ExportError(f"the export names an unknown {what} {str(name)[:80]!r}")
    return value
