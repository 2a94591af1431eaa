"""capture/opaque.py: which modules make custom autograd Function calls (recorded per call), the
modules export must then keep opaque, and the calls it cannot keep exact, refused by name."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.utils.checkpoint

from fxckpt.capture.opaque import function_callers, recording
from fxckpt.errors import CaptureError


class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return 2 * grad


class Calls(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Double.apply(x)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(2, 2), Calls())
        self.other = Calls()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.other(self.block(x)) + Double.apply(x)


def test_each_call_is_recorded_with_its_innermost_module() -> None:
    model = Net()
    with recording(model) as calls:
        model(torch.ones(1, 2))
    assert calls == [(Double, "block.1"), (Double, "other"), (Double, "")]
    assert Double.apply(torch.ones(1)).item() == 2.0 and len(calls) == 3  # unpatched after


def test_torchs_own_functions_and_other_threads_are_not_recorded() -> None:
    model = Net()
    with recording(model) as calls:
        torch.nn.functional.dropout(torch.ones(2), 0.5)
        thread = threading.Thread(target=lambda: model.block(torch.ones(1, 2)))
        thread.start()
        thread.join()
    assert calls == []


def test_the_innermost_callers_not_yet_opaque_once_each() -> None:
    calls = [(Double, "block.1"), (Double, "other"), (Double, "block.1"), (Double, "x.y")]
    assert function_callers(Net(), calls, ()) == ("block.1", "other", "x.y")
    assert function_callers(Net(), calls, ("block", "x")) == ("other",)


def test_a_call_from_forward_itself_is_refused() -> None:
    with pytest.raises(CaptureError, match=r"^Net.forward calls the custom autograd "
                                           r"Function\(s\) Double directly"):
        function_callers(Net(), [(Double, "other"), (Double, "")], ())


def test_a_reentrant_checkpoint_is_refused_naming_where() -> None:
    reentrant = torch.utils.checkpoint.CheckpointFunction
    with pytest.raises(CaptureError, match=r"use_reentrant=True\) \(in <root>, block\)"):
        function_callers(Net(), [(reentrant, "block"), (reentrant, "")], ())
