"""runtime/selective.py: a kept node's main call runs once, in the segment's forward; its
recompute gets the kept output back instead of running it again, once, and only unchanged."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fxckpt.runtime.selective import Keeper, active, keep_begin, keep_end


class Calls(TorchDispatchMode):
    """The aten calls that reach the kernels (entered first: below the keeper's mode), but the
    ``detach`` the keeper makes of what it keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ != "detach":
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


A, B = torch.randn(3, 4), torch.randn(4, 2)


def _node(calls: Calls) -> torch.Tensor:
    """One kept node: ``mm`` (its main call), then a copy of the output."""
    with calls:
        keep_begin(0)
        value = (A @ B).clone()
        return keep_end(0, value)


def _run(keeper: Keeper, phase: str) -> tuple[torch.Tensor, list[str]]:
    calls = Calls()
    keeper.enter(phase)
    try:
        assert active() is keeper
        return _node(calls), calls.names
    finally:
        keeper.leave()


def test_the_recompute_returns_the_kept_output_without_running_the_main_call() -> None:
    keeper = Keeper("segment_0")
    first, forward = _run(keeper, "forward")
    assert forward == ["mm", "clone"] and set(keeper.kept) == {0}
    again, recompute = _run(keeper, "recompute")
    assert recompute == ["clone"]  # the mm's output came from the forward
    assert torch.equal(again, first) and torch.equal(again, A @ B)
    assert keeper.phase == "idle" and active() is None


def test_outside_a_segment_run_the_brackets_do_nothing() -> None:
    calls = Calls()
    value = _node(calls)
    assert calls.names == ["mm", "clone"] and torch.equal(value, A @ B)
    assert keep_end(3, "anything") == "anything"


def test_a_second_backward_through_kept_outputs_is_refused() -> None:
    keeper = Keeper("segment_2")
    _run(keeper, "forward")
    _run(keeper, "recompute")
    with pytest.raises(RuntimeError, match=r"^segment_2: backward ran through a segment with "
                                           r"kept outputs a second time.*selective=False"):
        _run(keeper, "recompute")


def test_a_kept_output_written_in_place_after_the_forward_is_refused() -> None:
    """The kept tensor shares the output's version counter (detached with the view key let
    through, as torch's selective checkpoint does): a later write is seen, not replayed."""
    a = A.clone().requires_grad_()
    keeper = Keeper("segment_1")
    keeper.enter("forward")
    keep_begin(0)
    kept = keep_end(0, a @ B)
    kept.add_(1)  # a later node of the forward writes it
    keeper.leave()
    keeper.enter("recompute")
    try:
        keep_begin(0)
        with pytest.raises(RuntimeError, match=r"^segment_1: the output of aten.mm.default kept "
                                               r"for the recompute was written in place"):
            a @ B
    finally:
        keeper.leave()


def test_a_node_that_is_only_a_cast_keeps_the_cast() -> None:
    keeper = Keeper("segment_3")
    x = torch.ones(2, dtype=torch.float64)

    def cast() -> tuple[torch.Tensor, list[str]]:
        calls = Calls()
        with calls:
            keep_begin(0)
            out = keep_end(0, x.to(torch.float32))
        return out, calls.names

    keeper.enter("forward")
    first, names = cast()
    keeper.leave()
    assert names == ["_to_copy"]
    keeper.enter("recompute")
    again, names = cast()
    keeper.leave()
    assert names == [] and torch.equal(again, first) and again.dtype == torch.float32
