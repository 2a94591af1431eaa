"""The closed allowlist of what a loaded export may call (fxckpt/export/allowlist.py).

The list is generated (``scripts/allowlist.py``) from what ``save`` writes for the models the
suite trains; these tests check what it holds against its rules, that a load refuses anything
else by name unless ``allow=`` names it, and that Tensor methods are saved as ``torch.Tensor``
calls whose receiver must be a tensor.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fxckpt
from fxckpt.export import ExportError
from fxckpt.export.allowlist import (ESCAPES, KINDS, allowlist, extended, names_used, permits,
                                     refusal)
from fxckpt.export.targets import _module_classes, resolve_function

LIST = Path(fxckpt.__file__).parent / "export" / "allowlist.json"


def test_every_entry_resolves_and_no_rule_refuses_it() -> None:
    data = json.loads(LIST.read_text())
    assert len(data["functions"]) > 150 and len(data["modules"]) > 20
    for kind in KINDS:
        for name, source in data[kind].items():
            assert refusal(kind, name) is None, (kind, name)
            assert isinstance(source, str) and ":" in source  # the model that needed it
            assert permits(kind, name)
    for name in data["functions"]:
        resolve_function(name, "test")
    for name in data["modules"]:
        assert name in _module_classes()
    for name, why in data["refused"].items():
        assert why and not any(permits(kind, name) for kind in KINDS), name


def test_no_entry_is_of_a_refused_family() -> None:
    functions = allowlist().functions
    assert not [n for n in functions if "_backward" in n]
    methods = {n.removeprefix("torch.Tensor.") for n in functions if n.startswith("torch.Tensor.")}
    assert not methods & ESCAPES
    assert "torch.ops.aten._reshape_alias.default" not in functions
    assert not [m for m in allowlist().modules if m.endswith((":ModuleList", ":ParameterDict",
                                                             ":ModuleDict", ":Sequential"))]


def test_the_rules() -> None:
    assert "backward" in str(refusal("functions", "torch.ops.aten.max_pool2d_with_indices_backward"
                                                  ".default"))
    assert "raw size, stride" in str(refusal("functions", "torch.ops.aten._reshape_alias.default"))
    assert refusal("functions", "torch.ops.aten._unsafe_view.default") is None  # reviewed
    assert "leaves the tensor world" in str(refusal("functions", "torch.Tensor.untyped_storage"))
    assert "container" in str(refusal("modules", "torch.nn.modules.container:ParameterDict"))
    assert refusal("getattr", "__class__") == "not a Tensor property"
    assert refusal("attribute_functions", "builtins.getattr") == "not a torch tensor function"


def test_allow_widens_one_load_and_never_past_a_rule() -> None:
    name = "torch.ops.aten.special_erfcx.default"
    assert not permits("functions", name)
    with extended([name, "torch.ops.aten._reshape_alias.default"]):
        assert permits("functions", name)
        assert not permits("functions", "torch.ops.aten._reshape_alias.default")
    assert not permits("functions", name)


class Erfcx(nn.Module):
    """A model calling a function the zoo never needs (``torch.special.erfcx``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fc in self.fc:
            x = torch.special.erfcx(torch.tanh(fc(x)))
        return x


def test_an_export_off_the_list_saves_with_a_warning_and_loads_only_when_allowed(
        tmp_path: Path) -> None:
    x = torch.randn(4, 8)
    tm = fxckpt.transform(Erfcx(), every=1, example_inputs=(x,))
    with pytest.warns(UserWarning, match=r"torch\.special\.erfcx.*allow=\['torch\.special\."):
        fxckpt.save(tm, tmp_path / "e")
    with pytest.raises(ExportError, match=r"node '\w+' of programs/v0/\w+\.json calls "
                                          r"torch\.special\.erfcx, which is not on fxckpt's "
                                          r"allowlist .* allow="):
        fxckpt.load(tmp_path / "e")
    loaded = fxckpt.load(tmp_path / "e", allow=["torch.special.erfcx"])
    torch.testing.assert_close(loaded(x), tm(x), rtol=0, atol=0)
    with pytest.raises(fxckpt.ConfigError, match="allow must be a list of names"):
        fxckpt.load(tmp_path / "e", allow="torch.special.erfcx")


class Viewed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).view(-1, 2, 4).transpose(1, 2).reshape(-1, 8).sum(-1)


def test_methods_are_saved_as_tensor_functions_that_check_their_receiver(tmp_path: Path) -> None:
    x = torch.randn(4, 8)
    tm = fxckpt.transform(Viewed(), every=1, example_inputs=(x,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every name on the list: no warning
        fxckpt.save(tm, tmp_path / "v")
    programs = [json.loads(p.read_text()) for p in (tmp_path / "v").glob("programs/**/*.json")]
    ops = {n["op"] for p in programs for n in p["nodes"]}
    assert "call_method" not in ops
    used = names_used(json.loads((tmp_path / "v" / "structure.json").read_text()), programs)
    assert {"torch.Tensor.view", "torch.Tensor.transpose"} <= used["functions"]
    loaded = fxckpt.load(tmp_path / "v")
    targets = {n.target for m in loaded.graph_module.modules()
               if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes}
    assert {torch.Tensor.view, torch.Tensor.transpose} <= targets
    with pytest.raises(TypeError, match="'view' .* doesn't apply to a 'Linear' object"):
        torch.Tensor.view(loaded.graph_module.fc, -1)  # what a module as receiver meets
    torch.testing.assert_close(loaded(x), tm(x), rtol=0, atol=0)
