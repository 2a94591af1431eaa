"""Which capture and plan serve a call (fxckpt/serve/dispatch.py): shared across transforms,
renewed when the model changes."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import fxckpt
from patterns import Stack
from support import assert_steps_equal, run_step


def test_transforms_of_one_model_share_its_capture() -> None:
    model = Stack()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 16)
    first = fxckpt.transform(model, every=1, example_inputs=(x,))
    second = fxckpt.transform(model, depth=2, example_inputs=(x,))
    assert fxckpt.inspect(first).captures == 1 and fxckpt.inspect(second).captures == 0
    assert fxckpt.inspect(second).plans_made == 1
    assert fxckpt.inspect(first).plan.segments != fxckpt.inspect(second).plan.segments
    assert_steps_equal(run_step(second, (x,), {}), run_step(reference, (x,), {}))


def test_a_replaced_submodule_or_a_new_hook_captures_again() -> None:
    model = Stack()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 16)
    tm = fxckpt.transform(model, every=1)
    tm(x)
    model.head = nn.Linear(16, 4)  # the old graph would call the old head
    reference.head = copy.deepcopy(model.head)
    third = fxckpt.transform(model, every=1)
    assert_steps_equal(run_step(third, (x,), {}), run_step(reference, (x,), {}))
    assert fxckpt.inspect(third).captures == 1

    seen: list[int] = []
    for m in (model, reference):
        m.blocks[0].register_forward_hook(lambda mod, args, out: seen.append(out.shape[0]))
    assert_steps_equal(run_step(third, (x,), {}, seed=1), run_step(reference, (x,), {}, seed=1))
    assert seen == [4, 4] and fxckpt.inspect(third).captures == 2
