"""export/describe.py: everything fxckpt.save writes, in memory: the module's state under each
of its names, one entry per planned variant, graph programs and views, and the plan."""

from __future__ import annotations

import json

import pytest
import torch

import fxckpt
from fxckpt.export import ExportError
from fxckpt.export.describe import describe, loose_key
from handmade import Tiny


class Tied(Tiny):
    def __init__(self) -> None:
        super().__init__()
        self.fc3 = torch.nn.Linear(8, 8)
        self.fc3.weight = self.fc2.weight

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return super().forward(x) * scale


@pytest.fixture(scope="module")
def tm() -> torch.nn.Module:
    tm = fxckpt.transform(Tied(), every=1, capture="symbolic_trace")
    tm(torch.randn(3, 4))
    return tm


def test_a_module_that_has_not_planned_has_nothing_to_describe() -> None:
    with pytest.raises(ExportError, match="^this module has not planned yet"):
        describe(fxckpt.transform(Tiny(), every=1))


def test_each_tensor_is_written_once_under_the_first_name_it_has(tm) -> None:
    described = describe(tm)
    assert sorted(described.tensors) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight",
                                         "fc3.bias", "head.bias", "head.weight", "scale"]
    assert described.tensors["fc2.weight"] is tm.fc2.weight
    state = {e["name"]: e for e in described.structure["state"]}
    assert state["fc3.weight"]["key"] == "fc2.weight"  # tied: one tensor, two names
    assert state["scale"] == {"name": "scale", "key": "scale", "kind": "buffer",
                              "persistent": True}
    assert state["fc1.weight"]["kind"] == "parameter"


def test_the_variant_holds_its_signature_its_plan_and_its_programs(tm) -> None:
    described = describe(tm)
    assert described.structure["training"] is True
    (variant,) = described.structure["variants"]
    assert variant["training"] is True and variant["capture"] == "symbolic_trace"
    assert variant["parameters"] == [
        {"name": "x", "kind": "POSITIONAL_OR_KEYWORD"},
        {"name": "scale", "kind": "POSITIONAL_OR_KEYWORD", "default": 1.0}]
    assert variant["plan"] == described.plan == fxckpt.inspect(tm).plan.to_dict()
    assert "programs/v0/root.json" in described.texts
    assert all(isinstance(json.loads(text), (dict, list)) for text in described.texts.values())


def test_the_loose_key_drops_shapes_and_device_indices_but_keeps_values() -> None:
    key = (True, "spec", (("tensor", (2, 3), torch.float32, "cpu", None),
                          ("value", "bool", (bool, True))))
    assert loose_key(key) == (True, "spec", (("tensor", torch.float32),
                                             ("value", "bool", (bool, True))))
