"""Function-valued attributes (``TransformerEncoderLayer.activation = F.relu``) in an export.

They are saved by their name in the table of :mod:`fxckpt.export.targets` and looked up there on
load; a function outside the table is refused at save time, and a file naming one at load time.
"""

from __future__ import annotations

import functools
import sys
import warnings
import json
import re
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxckpt
from fxckpt.export import ExportError, LoadedModule
from fxckpt.export.codec import Unencodable
from support import assert_steps_equal, run_step


class Stack(nn.Module):
    """Encoder layers inside a model, in eval mode: fxckpt traces torch.nn's transformer layers
    through only in training (fxckpt.capture.nn_modules), so these stay leaf modules and the
    export rebuilds each one from its class and attributes, ``activation`` among them."""

    def __init__(self, activation: Any, depth: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True,
                                       activation=activation)
            for _ in range(depth)
        )
        self.layers.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Gated(nn.Module):
    """A user's model that keeps its activation function as an attribute."""

    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor] = F.gelu) -> None:
        super().__init__()
        self.act = act
        self.fc = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fc in self.fc:
            x = self.act(fc(x))
        return x


def _round_trip(model: nn.Module, x: torch.Tensor, path: Path, allow: tuple[str, ...] = (),
                **options: Any) -> LoadedModule:
    tm = fxckpt.transform(model, **options, example_inputs=(x,))
    fxckpt.save(tm, path)
    loaded = fxckpt.load(path, allow=allow)
    assert_steps_equal(run_step(model, (x,), {}), run_step(loaded, (x,), {}))
    return loaded


def _activations(path: Path) -> list[Any]:
    structure = json.loads((path / "structure.json").read_text())
    return [e["attrs"]["activation"] for e in structure["variants"][0]["modules"]
            if e.get("cls") == "torch.nn.modules.transformer:TransformerEncoderLayer"]


def test_a_transformer_encoder_layer_round_trips_with_exact_grads(tmp_path: Path) -> None:
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True,
                                       activation="gelu")
    _round_trip(layer, torch.randn(3, 5, 16), tmp_path / "e", every=1)


@pytest.mark.parametrize(
    "activation, name",
    [(F.relu, "torch.nn.functional.relu"), (F.gelu, "torch.nn.functional.gelu"),
     ("gelu", "torch.nn.functional.gelu"), (torch.tanh, "torch.tanh")],
)
def test_activations_are_saved_by_name_and_resolved_on_load(
        tmp_path: Path, activation: Any, name: str) -> None:
    """relu and gelu are on the allowlist; torch.tanh is a torch tensor function it does not
    hold, which a load admits when asked to."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.tanh: not on the list, said at save
        loaded = _round_trip(Stack(activation), torch.randn(3, 5, 16), tmp_path / "e",
                             allow=(name,), depth=2)
    assert _activations(tmp_path / "e") == [{"__function__": name}] * 2
    layers = [m for m in loaded.graph_module.modules()
              if isinstance(m, nn.TransformerEncoderLayer)]
    expected = activation if callable(activation) else F.gelu
    assert len(layers) == 2 and all(m.activation is expected for m in layers)


def test_a_model_holding_a_function_round_trips(tmp_path: Path) -> None:
    _round_trip(Gated(F.gelu), torch.randn(4, 16), tmp_path / "g", every=1)


@pytest.mark.parametrize(
    "activation",
    [functools.partial(F.gelu, approximate="tanh"), lambda t: t * torch.sigmoid(t)],
    ids=["partial", "lambda"],
)
def test_a_function_outside_the_table_is_refused_at_save_naming_the_attribute(
        tmp_path: Path, activation: Any) -> None:
    tm = fxckpt.transform(Stack(activation), depth=2, example_inputs=(torch.randn(3, 5, 16),))
    with pytest.raises(Unencodable) as e:
        fxckpt.save(tm, tmp_path / "e")
    assert str(e.value).startswith(
        "attribute 'activation' of TransformerEncoderLayer at layers.0 holds the function")
    assert "use a torch function (F.gelu) or a torch.nn module" in str(e.value)
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("name", ["torch.load", "torch.serialization.load", "os.system",
                                  "builtins.eval", "torch.nn.functional.F.torch.load",
                                  "builtins.getattr", "operator.setitem", "fxckpt.checkpoint"])
def test_a_file_naming_a_function_outside_the_table_is_refused(tmp_path: Path, name: str) -> None:
    from fxckpt.export.files import content_hash, sha256_bytes

    root = tmp_path / "e"
    fxckpt.save(fxckpt.transform(Stack(F.relu), depth=2,
                                 example_inputs=(torch.randn(3, 5, 16),)), root)
    text = (root / "structure.json").read_text()
    forged = text.replace('"torch.nn.functional.relu"', json.dumps(name))
    assert forged != text
    (root / "structure.json").write_text(forged)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"]["structure.json"] = sha256_bytes(forged.encode())
    manifest["content_hash"] = content_hash(manifest["files"])
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match=re.escape(
            f"holds the function {name!r}; a saved module's attribute may hold a torch tensor "
            "function only")):
        fxckpt.load(root)


def test_no_callable_a_loaded_export_may_name_reaches_python_itself() -> None:
    """The tables are closed: no entry hands back functions, modules, frames or attributes of
    the caller's choosing (``getattr`` only through graph nodes whose name is a checked Tensor
    property; module attributes only torch tensor functions)."""
    import builtins
    import functools
    import importlib
    import inspect as inspect_module
    import operator as op

    from fxckpt.export import targets

    reflective = {builtins.getattr, builtins.setattr, builtins.delattr, builtins.vars,
                  builtins.globals, builtins.locals, builtins.eval, builtins.exec,
                  builtins.compile, builtins.__import__, builtins.open, builtins.type,
                  builtins.object, builtins.super, op.attrgetter, op.methodcaller,
                  functools.partial, importlib.import_module, sys._getframe,
                  inspect_module.currentframe}
    table, _ = targets._functions()
    found = {name for name, fn in table.items() if fn in reflective}
    assert found == {"builtins.getattr"}  # graph nodes only: checked against GETATTR_NAMES
    attribute_table = targets._namespace_functions()
    assert attribute_table and all(
        name.startswith(("torch.", "torch.nn.functional.")) and fn not in reflective
        and not name.startswith(("torch.Tensor.", "torch.ops."))
        for name, fn in attribute_table.items())
    assert not any(targets.unchecked(name.rpartition(".")[2]) for name in table)
    assert not any(targets.unchecked(name) for name in targets.METHODS)
