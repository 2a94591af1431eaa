"""Verify a plan by executing it: one training step on fake tensors, every storage counted.

The simulator (:mod:`fxckpt.solver.simulate`) counts the tensors of the graph. A real step holds
more: the gradient of a weight before it is added into ``.grad``, the input gradient a matmul
makes while the output gradient is still alive, the loss's own saved tensors, the buffers
checkpoint's recompute makes, autograd's copies. On wide layers those decide the peak (a
24 x Linear(1024) MLP at batch 2048: simulated 120 MiB, held 136 MiB).

So a plan is also *run*: the rewritten graph, the loss (the user's ``loss_fn``, or a stand-in
that holds at least what cross-entropy or mean squared error would: :func:`stand_in_loss`) and
backward, with gradients
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

from fxckpt.errors import FxckptError, VerifyError
from fxckpt.measure.tracker import LiveTensorTracker
from fxckpt.measure.meta_run import fake_twin, meta_twin, on_meta
from fxckpt.runtime.offload import offload_simulated
from fxckpt.cost.scratch import call_scratch

__all__ = ["VerifyError", "LossFn", "fake_step_peak", "stand_in_loss", "STAND_IN"]

log = logging.getLogger(__name__)

LossFn = Callable[..., torch.Tensor]
"""``loss_fn(output, *args, **kwargs) -> scalar``: the loss of one call's output."""


def fake_step_peak(
    root: torch.nn.Module,
    run: Callable[[tuple, dict], Any],
    args: tuple,
    kwargs: dict,
    *,
    loss_fn: Optional[LossFn] = None,
    device: Optional[str] = None,
    meta: Optional[bool] = None,
) -> int:
    """Peak bytes one training step ``loss(run(args, kwargs)).backward()`` adds, on fake tensors.

    ``root`` owns every parameter and buffer ``run`` reads (they are swapped for fake twins);
    ``device`` picks the device whose peak is returned (default: all devices together).
    ``meta``: run on meta twins instead, which is what fake tensors of meta tensors compute
    (:mod:`fxckpt.measure.meta_run`); by default when every tensor is on meta, on fake tensors if
    that fails.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    if meta is None:
        meta = on_meta(root, args, kwargs)
    # Constants a loss_fn closes over are allowed (faked where used).
    mode: Any = contextlib.nullcontext() if meta else FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            memo[id(t)] = meta_twin(t) if meta else fake_twin(mode, t)
        return memo[id(t)]

    try:
        # Segments a plan offloads drop what they would move until backward (offload_simulated).
        # Fake and meta tensors draw nothing from torch's generators: no fork (a fork would
        # rewind another thread's draws, fxckpt.runtime.state).
        # A user's saved_tensors_hooks around the call that plans (the first step) must not
        # see the fake step: hooks of its own, innermost, stand in front of them.
        with _swapped_state(root, fake), mode, offload_simulated(), \
                torch.autograd.graph.saved_tensors_hooks(_same, _same):
            fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, fake, (args, kwargs))
            _existing_grads(memo.values())
            with LiveTensorTracker(fake=True, scratch=call_scratch) as tracker:
                output = run(fake_args, fake_kwargs)
                loss = _loss(output, loss_fn, fake_args, fake_kwargs)
                if loss_fn is not None:
                    del output  # the output is now held only by what the user's loss saved
                if loss is not None:
                    loss.backward()
                del loss
    except FxckptError:
        raise
    except Exception as e:
        if meta:  # an op without a meta kernel, a constant on another device: fake them
            log.debug("fxckpt: the step did not run on meta tensors (%s); faking them", e)
            return fake_step_peak(root, run, args, kwargs, loss_fn=loss_fn, device=device,
                                  meta=False)
        raise VerifyError(
            f"the training step could not run on fake tensors: {type(e).__name__}: {e}"
        ) from e
    if device is None:
        return tracker.peak_bytes
    return tracker.peak_bytes_by_device.get(_normal(device), tracker.peak_bytes)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


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
    return stand_in_loss(output)


STAND_IN = ("the output through backward and a cross-entropy over its last dimension in fp32, "
            "times the output (the log-softmax and the fp32 output saved, full-size "
            "gradients), which holds at least what cross-entropy, F.mse_loss or a reduction "
            "of the output's square in fp32 hold")
"""What the stand-in loss holds (said in the notes of plans made without ``loss_fn``)."""


def stand_in_loss(output: Any) -> Optional[torch.Tensor]:
    """The loss assumed without ``loss_fn``: at least what the common losses hold.

    Cross-entropy over logits (``logits.float()``, the log-softmax saved, a full-size gradient
    made while it is alive), ``F.mse_loss`` (the input saved, a full-size gradient) and a
    reduction of the output's square in fp32 (``logits.float().square().mean()``: the fp32 copy
    saved, and in backward the gradient, ``2 * x`` and their product at once) are what most
    steps end in, and the caller often keeps the output (``out = model(x); loss_fn(out,
    y).backward()``). So the caller (:func:`fake_step_peak`) keeps the output until backward
    ends, and each differentiable output ``w = out.float()`` goes through
    ``(log_softmax(w, -1) * w).mean()``: at least what each of those holds, in fp32 and in
    bf16 (``tests/test_stand_in.py``; the square of a bf16 output in fp32 holds eleven bf16
    outputs' worth at its peak, cross-entropy seven). A hand-written ``(out - y).square().mean()``
    in fp32 holds one output more (its difference); ``loss_fn=`` fits the plan to the real loss
    instead.
    """
    leaves = [t for t in pytree.tree_leaves(output)
              if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    terms = []
    for t in leaves:
        wide = t.float()
        terms.append((torch.log_softmax(wide, dim=-1) * wide).mean() if wide.dim() else wide)
    return sum(terms, torch.zeros(())) if terms else None


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
