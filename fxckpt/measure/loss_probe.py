"""What the user's loss holds: measured on fake outputs, for the planner's model of the step.

The graph ends at the model's outputs; the loss runs after them, and its memory is part of the
step. The planner models it as one synthetic op (:mod:`fxckpt.cost.bridge`), assumed to
keep one tensor as large as the outputs and to make their gradients. A loss can hold far more:
``logits.float().square().mean()`` keeps the logits and, in its backward, makes the gradient of
the mean, ``logits ** 1``, ``2 * logits`` and the product at once: five times the logits at its
peak, where two (and the reserve for temporaries, one more) were assumed. On a Llama-style
model (6 layers, vocabulary 1024, batch 8 x 256) the plan with the smallest simulated peak then
kept 41 MiB until the loss and peaked there at 73.4 MiB (verified), above per-block
checkpointing's 62.9 MiB; with the loss measured, the smallest plan reaches 56.6 MiB (56.5 MiB
measured).

So when the user gives ``loss_fn`` and plans are verified, the loss is also run alone, once:

    first verified step --output--> layout (tree, shapes, dtypes; no tensor kept)
    fake outputs laid out so --loss_fn, backward--> peak bytes   (LiveTensorTracker)

Each output is a fresh storage the loss lets go of as it lets go of the model's, so the peak
counts the outputs while the loss keeps them, the loss's own tensors and the outputs' gradients.
The loss op then holds that peak less the outputs' gradients (its backward makes them) and less
the reserve every simulated peak includes (:attr:`fxckpt.solver.Problem.reserve_bytes`), so
that the prediction at the loss is what the verified step holds there.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Union

import torch
import torch.utils._pytree as pytree

from fxckpt.errors import FxckptError
from fxckpt.measure.tracker import LiveTensorTracker
from fxckpt.cost.scratch import call_scratch
from fxckpt.measure.verify import LossFn, VerifyError, _swapped_state

__all__ = ["OutputLayout", "output_layout", "fake_loss_peak", "LossProbe"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """One output tensor's metadata: what a fake twin of it needs."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


Plain = Union[None, bool, int, float, str]


@dataclasses.dataclass(frozen=True)
class OutputLayout:
    """What one call returned, without its tensors: the tree, and per leaf a tensor's metadata
    or a plain value (no tensor is kept, so recording it frees nothing later in the step)."""

    spec: pytree.TreeSpec
    leaves: tuple[Union[TensorLayout, Plain], ...]


def output_layout(output: Any) -> Optional[OutputLayout]:
    """The layout of ``output``; ``None`` when a leaf is neither a tensor of static shape nor a
    plain value (an object that could not be made again without keeping the original)."""
    leaves, spec = pytree.tree_flatten(output)
    laid: list[Union[TensorLayout, Plain]] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if not all(isinstance(d, int) for d in leaf.shape):
                return None
            laid.append(TensorLayout(tuple(leaf.shape), leaf.dtype, leaf.device,
                                     leaf.requires_grad))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            laid.append(leaf)
        else:
            return None
    return OutputLayout(spec, tuple(laid))


def fake_loss_peak(root: torch.nn.Module, layout: OutputLayout, args: tuple, kwargs: dict, *,
                   loss_fn: LossFn, device: Optional[str] = None) -> int:
    """Peak bytes ``loss_fn(output, *args, **kwargs)`` and its backward add, on fake outputs laid
    out as ``layout`` (each a fresh storage, counted while the loss keeps it; the gradients they
    receive included). ``root``'s parameters and buffers are swapped for fake twins, as in
    :func:`fxckpt.measure.verify.fake_step_peak`; ``device`` picks the device whose peak is
    returned.
    Raises :class:`~fxckpt.measure.verify.VerifyError` when the loss cannot run so.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)  # constants a loss_fn closes over
    memo: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            memo[id(t)] = mode.from_tensor(t)
        return memo[id(t)]

    try:
        with _swapped_state(root, fake), mode:  # fake tensors draw nothing: no fork
            fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, fake, (args, kwargs))
            for t in memo.values():  # the steady state: parameter gradients added in place
                if t.requires_grad and t.is_leaf and t.grad is None:
                    t.grad = torch.zeros_like(t)
            bases = [_twin(leaf) for leaf in layout.leaves]
            with LiveTensorTracker(fake=True, scratch=call_scratch) as tracker:
                outs = [b.clone() if isinstance(b, torch.Tensor) else b for b in bases]
                output = pytree.tree_unflatten(outs, layout.spec)
                del outs
                loss = loss_fn(output, *fake_args, **fake_kwargs)
                del output
                if isinstance(loss, torch.Tensor) and loss.requires_grad:
                    loss.backward()
                del loss
    except FxckptError:
        raise
    except Exception as e:
        raise VerifyError(f"the loss could not run on fake outputs: {type(e).__name__}: {e}") \
            from e
    if device is None:
        return tracker.peak_bytes
    d = torch.device(device)
    key = "cuda:0" if d.type == "cuda" and d.index is None else str(d)
    return tracker.peak_bytes_by_device.get(key, tracker.peak_bytes)


def _twin(leaf: Union[TensorLayout, Plain]) -> Union[torch.Tensor, Plain]:
    if not isinstance(leaf, TensorLayout):
        return leaf
    return torch.empty(leaf.shape, dtype=leaf.dtype, device=leaf.device,
                       requires_grad=leaf.requires_grad)


class LossProbe:
    """The user's loss, measured once: :meth:`saw` records the first verified step's output
    layout, :meth:`peak` runs :func:`fake_loss_peak` on it at the first ask. ``None`` when the
    output could not be laid out or the loss not run alone: the planner then assumes it."""

    def __init__(self, loss_fn: LossFn, args: tuple, kwargs: dict, device: str) -> None:
        self.loss_fn, self.args, self.kwargs, self.device = loss_fn, args, kwargs, device
        self.layout: Optional[OutputLayout] = None
        self.seen = False
        self.measured: Optional[int] = None

    def saw(self, output: Any) -> Any:
        """Record ``output``'s layout, the first time; returns ``output``."""
        if not self.seen:
            self.seen, self.layout = True, output_layout(output)
        return output

    def peak(self, root: torch.nn.Module) -> Optional[int]:
        """What the loss holds at its peak (``root`` owns the state it may read)."""
        if self.layout is not None:
            try:
                self.measured = fake_loss_peak(root, self.layout, self.args, self.kwargs,
                                               loss_fn=self.loss_fn, device=self.device)
            except VerifyError as e:
                log.info("fxckpt: the loss's memory is assumed, not measured: %s", e)
            self.layout = None  # measured once, or not at all
        return self.measured
