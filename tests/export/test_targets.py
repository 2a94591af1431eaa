"""export/targets.py: the fixed table of what a loaded export may name, functions by table name,
ATen operators checked against the dispatcher, torch.nn classes, dtypes and layouts."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

from fxckpt.export import ExportError
from fxckpt.export.targets import (DTYPES, GETATTR_NAMES, LAYOUTS, MEMORY_FORMATS, METHODS,
                                   function_name, lookup, module_class_path,
                                   resolve_attribute_function, resolve_function,
                                   resolve_module_class, table_name)


@pytest.mark.parametrize("fn, name", [(torch.relu, "torch.relu"), (operator.mul, "operator.mul"),
                                      (torch.ops.aten.addmm.default,
                                       "torch.ops.aten.addmm.default")])
def test_call_targets_are_saved_by_table_name_and_resolved_back(fn, name: str) -> None:
    assert function_name(fn, "node 'n'") == name
    assert resolve_function(name, "node 'n'") is fn


def test_table_name_is_none_outside_the_table() -> None:
    assert table_name(F.gelu) == "torch.nn.functional.gelu"
    assert table_name(print) is None and table_name(lambda: None) is None


def test_a_function_outside_the_table_is_refused_at_save_naming_it() -> None:
    def mine(x: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises(ExportError, match=r"^node 'n' calls .*mine, which is not one of the "
                                          r"functions a loaded export may call"):
        function_name(mine, "node 'n'")


def test_a_custom_autograd_function_is_refused_as_the_models_own_code() -> None:
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

    def target(x: torch.Tensor) -> torch.Tensor:  # as fxckpt's tracer marks a Function's call
        return Twice.apply(x)

    target.fxckpt_function = Twice
    with pytest.raises(ExportError, match=r"calls the custom autograd Function .*Twice: its "
                                          r"forward and backward are the model's own code"):
        function_name(target, "node 'n'")


@pytest.mark.parametrize("name, message", [
    ("builtins.exec", "not on fxckpt's allowlist"),
    ("torch.ops.aten.mm.nonsense", "not on fxckpt's allowlist"),
    (3, "a call target must be a name, not int"),
])
def test_names_off_the_allowlist_are_refused_at_load(name, message: str) -> None:
    with pytest.raises(ExportError, match=message):
        resolve_function(name, "node 'n'")


def test_attribute_functions_are_torch_tensor_functions_only() -> None:
    assert resolve_attribute_function("torch.nn.functional.relu", "attr") is F.relu
    for name in ("operator.getitem", "builtins.getattr", "os.system", None):
        with pytest.raises(ExportError, match="attr holds the function"):
            resolve_attribute_function(name, "attr")


def test_methods_and_properties_a_graph_may_use() -> None:
    assert "view" in METHODS and "register_hook" not in METHODS and 3 not in METHODS
    assert "shape" in GETATTR_NAMES and "__class__" not in GETATTR_NAMES
    assert list(GETATTR_NAMES) == sorted(GETATTR_NAMES)


def test_torch_nn_leaf_classes_round_trip_and_others_are_refused() -> None:
    path = module_class_path(torch.nn.Linear, "the module at fc")
    assert path == "torch.nn.modules.linear:Linear"
    assert resolve_module_class(path, "the module at fc") is torch.nn.Linear

    class Mine(torch.nn.Linear):
        pass

    with pytest.raises(ExportError, match=r"^the module at fc is a .*Mine, not one of the "
                                          r"torch.nn module classes"):
        module_class_path(Mine, "the module at fc")
    with pytest.raises(ExportError, match="names the module class 'os:system'"):
        resolve_module_class("os:system", "the module at fc")


def test_a_container_is_rebuilt_only_inside_a_leaf() -> None:
    path = "torch.nn.modules.container:ModuleList"
    assert resolve_module_class(path, "m", inside_leaf=True) is torch.nn.ModuleList
    with pytest.raises(ExportError, match="not a leaf module class on fxckpt's allowlist"):
        resolve_module_class(path, "m")


def test_dtypes_layouts_and_memory_formats_by_name() -> None:
    assert DTYPES["bfloat16"] is torch.bfloat16 and LAYOUTS["strided"] is torch.strided
    assert MEMORY_FORMATS["channels_last"] is torch.channels_last
    assert lookup(DTYPES, "float32", "dtype") is torch.float32
    with pytest.raises(ExportError, match="^the export names an unknown dtype 'float99'$"):
        lookup(DTYPES, "float99", "dtype")
    with pytest.raises(ExportError, match="unknown layout"):
        lookup(LAYOUTS, ["strided"], "layout")
