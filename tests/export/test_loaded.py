"""export/loaded.py: a LoadedModule serves its saved variants by signature (a symbolic graph any
batch size), binds calls to the saved forward signature and keeps its graphs' tensors in step
with ``.to()``."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

import fxckpt
from fxckpt.export import ExportError, LoadedModule
from fxckpt.export.loaded import _UNSAVED, _signature


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return torch.relu(self.fc(x)) * scale


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    model = Scaled()
    tm = fxckpt.transform(model, every=1, capture="symbolic_trace")
    tm(torch.randn(3, 4))
    path = tmp_path_factory.mktemp("export") / "scaled"
    fxckpt.save(tm, path)
    return path, model


def test_the_loaded_module_computes_the_models_output_at_any_batch_size(saved) -> None:
    path, model = saved
    loaded = fxckpt.load(path)
    assert isinstance(loaded, LoadedModule) and loaded.training
    for batch in (3, 5):
        x = torch.randn(batch, 4)
        assert torch.equal(loaded(x), model(x))
    with pytest.raises(ExportError, match=r"the call is train \(float32\[5, 4\], scale=0.5\)"):
        loaded(x, scale=0.5)  # a value the graph was specialised to
    assert len(loaded.variants) == 1 and loaded.variant is loaded.variants[0]
    assert loaded.plan.capture == "symbolic_trace"
    assert "fxckpt_checkpoint(segment_0, x)" in loaded.code
    assert "variants=['train (float32[3, 4])']" in repr(loaded)


def test_a_call_no_variant_serves_is_refused_saying_what_the_export_holds(saved) -> None:
    loaded = fxckpt.load(saved[0]).eval()
    with pytest.raises(ExportError, match=r"^this export holds graphs for train .*; the call is "
                                          r"eval \(float32\[3, 4\]\)\. Without the model's code"):
        loaded(torch.randn(3, 4))


def test_to_puts_the_converted_tensors_into_every_graph_slot(saved) -> None:
    loaded = fxckpt.load(saved[0]).to(torch.float64)
    assert loaded.fc.weight.dtype == torch.float64
    slots = [s for v in loaded.variants for s in v.slots if s[1] in ("param", "buffer")]
    assert slots
    for module, kind, name, _ in slots:
        tensor = module._parameters[name] if kind == "param" else module._buffers[name]
        assert tensor.dtype == torch.float64, name


def test_the_manifest_is_a_copy(saved) -> None:
    loaded = fxckpt.load(saved[0])
    loaded.manifest["files"] = {}
    assert loaded.manifest["files"]


def test_the_saved_signature_keeps_kinds_and_defaults() -> None:
    signature = _signature([
        {"name": "x", "kind": "POSITIONAL_ONLY"},
        {"name": "mask", "kind": "POSITIONAL_OR_KEYWORD", "default": None},
        {"name": "config", "kind": "KEYWORD_ONLY", "default_unsaved": True},
        {"name": "rest", "kind": "VAR_KEYWORD"}])
    assert str(signature) == "(x, /, mask=None, *, config=%r, **rest)" % _UNSAVED
    params = signature.parameters
    assert params["x"].default is inspect.Parameter.empty
    assert params["config"].default is _UNSAVED
