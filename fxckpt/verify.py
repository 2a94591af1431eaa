"""Verify a plan by executing it: one training step on fake tensors, every storage counted.

The simulator (:mod:`fxckpt.solver.simulate`) counts the tensors of the graph. A real step holds
more: the gradient of a weight before it is added into ``.grad``, the input gradient a matmul
makes while the output gradient is still alive, the loss's own saved tensors, the buffers
checkpoint's recompute makes, autograd's copies. On wide layers those decide the peak (a
24 x Linear(1024) MLP at batch 2048: simulated 120 MiB, held 136 MiB).

So a plan is also *run*: the rewritten graph, the loss (the user's ``loss_fn``, or a stand-in
that makes a full-size gradient for every differentiable output) and backward, with gradients
accumulated into existing ``.grad`` as in the steady state of training — all on fake tensors
(``FakeTensorMode``: shapes and dtypes, no memory), under
:class:`~fxckpt.measure.LiveTensorTracker`, which counts every storage an op makes until it is
freed. Parameters, buffers and inputs are swapped for fake twins for the run and put back after;
the module, its ``.grad`` and the RNG are left as they were.

The peak counts what the step adds to what was held before it, like the budget (parameters,
gradients and inputs are not counted): on the model's device, or over all devices.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.utils._pytree as pytree

from fxckpt.errors import FxckptError
from fxckpt.measure import LiveTensorTracker
from fxckpt.scratch import call_scratch

__all__ = ["VerifyError", "LossFn", "fake_step_peak"]

log = logging.getLogger(__name__)

LossFn = Callable[..., torch.Tensor]
"""``loss_fn(output, *args, **kwargs) -> scalar``: the loss of one call's output."""


class VerifyError(FxckptError, RuntimeError):
    """A training step could not be executed on fake tensors (the plan is then only simulated)."""


def fake_step_peak(
    root: torch.nn.Module,
    run: Callable[[tuple, dict], Any],
    args: tuple,
    kwargs: dict,
    *,
    loss_fn: Optional[LossFn] = None,
    device: Optional[str] = None,
) -> int:
    """Peak bytes one training step ``loss(run(args, kwargs)).backward()`` adds, on fake tensors.

    ``root`` owns every parameter and buffer ``run`` reads (they are swapped for fake twins);
    ``device`` picks the device whose peak is returned (default: all devices together).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)  # constants a loss_fn closes over
    memo: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            memo[id(t)] = mode.from_tensor(t)
        return memo[id(t)]

    try:
        with torch.random.fork_rng(devices=[]), _swapped_state(root, fake), mode:
            fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, fake, (args, kwargs))
            _existing_grads(memo.values())
            with LiveTensorTracker(fake=True, scratch=call_scratch) as tracker:
                loss = _loss(run(fake_args, fake_kwargs), loss_fn, fake_args, fake_kwargs)
                if loss is not None:  # the output is now held only by what saved it
                    loss.backward()
                del loss
    except FxckptError:
        raise
    except Exception as e:
        raise VerifyError(
            f"the training step could not run on fake tensors: {type(e).__name__}: {e}"
        ) from e
    if device is None:
        return tracker.peak_bytes
    return tracker.peak_bytes_by_device.get(_normal(device), tracker.peak_bytes)


def _normal(device: str) -> str:
    d = torch.device(device)
    return "cuda:0" if d.type == "cuda" and d.index is None else str(d)


@contextlib.contextmanager
def _swapped_state(root: torch.nn.Module,
                   convert: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Every parameter and buffer of ``root`` replaced by ``convert(t)`` (tied ones by one twin),
    in the modules' own tables, and put back on exit."""
    saved: list[tuple[dict, str, torch.Tensor]] = []
    # Tensors a forward stores as plain attributes (old-style weight_norm's ``weight``) are put
    # back too, so no fake tensor outlives the run.
    for module in root.modules():
        saved += [(module.__dict__, k, v) for k, v in list(module.__dict__.items())
                  if isinstance(v, torch.Tensor)]
    try:
        for module in root.modules():
            tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
            for table in tables:
                for name, t in list(table.items()):
                    if t is not None:
                        saved.append((table, name, t))
                        table[name] = convert(t)
        yield
    finally:
        for table, name, t in reversed(saved):
            table[name] = t


def _existing_grads(tensors: Iterable[torch.Tensor]) -> None:
    """Give every fake leaf that wants a gradient a ``.grad``, so backward accumulates into it
    (the steady state: the weight gradient is a temporary added in place)."""
    for t in tensors:
        if t.requires_grad and t.is_leaf and t.grad is None:
            t.grad = torch.zeros_like(t)


def _loss(output: Any, loss_fn: Optional[LossFn], args: tuple,
          kwargs: dict) -> Optional[torch.Tensor]:
    """The step's loss; ``None`` when nothing in the output needs a gradient."""
    if loss_fn is not None:
        loss = loss_fn(output, *args, **kwargs)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise FxckptError(
                f"loss_fn must return a scalar tensor (got {_describe(loss)}); it is called as "
                "loss_fn(output, *args, **kwargs) with the model's output and call arguments"
            )
        return loss if loss.requires_grad else None
    # The stand-in: each differentiable output gets a full-size gradient at the start of
    # backward, as most losses make (mean squared error, cross-entropy over logits), and the
    # output itself is not kept for it.
    leaves = [t for t in pytree.tree_leaves(output)
              if isinstance(t, torch.Tensor) and t.requires_grad]
    for t in leaves:
        t.register_hook(torch.Tensor.contiguous)
    return sum((t.sum() for t in leaves), torch.zeros(())) if leaves else None


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
