"""Measured memory over one training step, op by op, to lay over the predicted timeline.

:class:`~fxckpt.measure.LiveTensorTracker` gives the peak; a picture needs the whole curve.
:class:`OpTimeline` records the live tensor bytes after every op, tagged with the phase
(``forward`` until the loss exists, then ``backward``), so the curve can be drawn against the
simulator's events phase by phase. Measuring runs real steps, so :func:`measure_step` puts
back what they change: gradients, buffers (BatchNorm statistics) and the RNG state.

    warm-up step (gradients are allocated here, not in the measured step)
    measured step:  forward ops ... loss | backward ops (recompute included) ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils._pytree as pytree

from fxckpt.measure.tracker import LiveTensorTracker
from fxckpt.runtime.state import torch_random_kept, values_kept

__all__ = ["OpTimeline", "MeasuredStep", "measure_step", "default_loss"]


class OpTimeline(LiveTensorTracker):
    """A :class:`LiveTensorTracker` that also keeps ``(phase, op, live bytes)`` after every op."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.samples: list[tuple[str, str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.samples.append((self.phase, str(func), self.current_bytes))
        return out


@dataclasses.dataclass(frozen=True)
class MeasuredStep:
    """Live tensor bytes after each op of a measured training step."""

    forward: tuple[int, ...]
    """After each op of the forward pass and the loss."""
    backward: tuple[int, ...]
    """After each op of the backward pass (recomputation included)."""
    peak_bytes: int


def default_loss(out: Any) -> torch.Tensor:
    """Sum of squares of every floating-point tensor in the output (any structure)."""
    if hasattr(out, "keys") and not isinstance(out, dict):
        out = dict(out)  # ModelOutput and other mappings
    leaves = [
        t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    if not leaves:
        raise ValueError("the output has no floating-point tensor to take a loss of; pass loss=")
    return sum(t.float().pow(2).sum() for t in leaves)  # type: ignore[return-value]


def measure_step(module: torch.nn.Module, args: tuple, kwargs: Optional[dict] = None,
                 loss: Optional[Callable[[Any], torch.Tensor]] = None) -> MeasuredStep:
    """Run one warm-up and one measured training step of ``module``; leave its state as it was."""
    kwargs = dict(kwargs or {})
    loss_fn = loss or default_loss

    def step(timeline: Optional[OpTimeline] = None) -> None:
        value = loss_fn(module(*args, **kwargs))
        if timeline is not None:
            timeline.phase = "backward"
        value.backward()

    with _state_kept(module):
        step()
        gc.collect()
        with OpTimeline() as timeline:
            step(timeline)
    forward = tuple(b for phase, _, b in timeline.samples if phase == "forward")
    backward = tuple(b for phase, _, b in timeline.samples if phase == "backward")
    return MeasuredStep(forward, backward, timeline.peak_bytes)


@contextlib.contextmanager
def _state_kept(module: torch.nn.Module) -> Iterator[None]:
    params = list(module.parameters())
    grads = [p.grad for p in params]
    # a real step: its draws are undone unless another thread draws
    with values_kept(module.buffers()), torch_random_kept():
        try:
            for p in params:
                p.grad = None
            yield
        finally:
            for p, g in zip(params, grads):
                p.grad = g
