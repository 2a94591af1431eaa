"""runtime/assign.py: the attribute a forward assigns is set on each call, on the module held
weakly, and never while planning on fake tensors or while a segment is recomputed."""

from __future__ import annotations

import gc
import importlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxckpt.runtime.assign import Assignment, assign

# the module, not the function fxckpt.runtime re-exports under its name
checkpoint = importlib.import_module("fxckpt.runtime.checkpoint")


def test_assign_sets_the_attribute_on_the_module() -> None:
    module = torch.nn.Linear(2, 2)
    target = Assignment(module, "attn_map", "blocks.0.attn_map")
    value = torch.ones(3)
    assign(target, value)
    assert module.attn_map is value
    assert repr(target) == "Assignment(blocks.0.attn_map)"


def test_the_module_is_held_weakly_and_a_dead_one_is_skipped() -> None:
    module = torch.nn.Linear(2, 2)
    target = Assignment(module, "seen", "seen")
    del module
    gc.collect()
    assert target.module() is None
    assign(target, torch.ones(1))  # nothing to set, no error


def test_fake_tensors_are_not_assigned() -> None:
    module = torch.nn.Linear(2, 2)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.ones(2))
    assign(Assignment(module, "seen", "seen"), {"a": [fake]})
    assert not hasattr(module, "seen")


def test_nothing_is_assigned_while_a_segment_recomputes(monkeypatch) -> None:
    module = torch.nn.Linear(2, 2)
    monkeypatch.setattr(checkpoint._local, "depth", 1, raising=False)
    assign(Assignment(module, "seen", "seen"), torch.ones(1))
    assert not hasattr(module, "seen")


def test_generated_code_names_it_from_fxckpt() -> None:
    assert assign.__module__ == "fxckpt"
