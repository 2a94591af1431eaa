"""Exact recompute: the function every rewritten graph calls for a segment.

``checkpoint(segment, *inputs)`` runs ``segment`` without keeping its intermediate tensors and
runs it again in backward when autograd needs them. It is PyTorch's non-reentrant checkpoint
(``use_reentrant=False``), which already gives what our users rely on: ``.backward()`` and
``torch.autograd.grad`` both work, CPU and CUDA RNG states are replayed so dropout draws the
same mask, autocast is re-entered during recompute, non-tensor inputs and outputs pass through,
and parameter gradients arrive even when no input requires grad. On top of it fxckpt adds:

* buffers written by the first run (BatchNorm ``running_mean``/``running_var``/
  ``num_batches_tracked``) are put back after the recompute, so a training step updates them once;
* a recompute whose tensors differ from the first run raises
  :class:`~fxckpt.errors.RecomputeMismatchError` naming the segment;
* in ``eval()`` or under ``torch.no_grad()`` the segment is simply called: no overhead.

    forward:   inputs --segment (no grad, nothing kept)--> outputs        [keeps: inputs]
    backward:  inputs --segment again (kept)--> grads flow; buffers restored
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from fxckpt.errors import RecomputeMismatchError

__all__ = ["checkpoint", "is_recomputing"]

log = logging.getLogger(__name__)
_local = threading.local()


def is_recomputing() -> bool:
    """True while a segment is being recomputed in backward (on this thread)."""
    return getattr(_local, "depth", 0) > 0


def checkpoint(segment: torch.nn.Module, *inputs: Any) -> Any:
    """Run ``segment(*inputs)`` and recompute it in backward instead of keeping its activations."""
    if not (segment.training and torch.is_grad_enabled()):
        return segment(*inputs)
    call = _SegmentCall(segment)
    return torch_checkpoint.checkpoint(
        call.run,
        *inputs,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=call.contexts,
        determinism_check="default",
        early_stop=False,  # run the recompute to its end, so run() can compare the outputs
    )


# Generated code reads `fxckpt_checkpoint(segment_0, x)`; `fxckpt.checkpoint` is the public name.
checkpoint.__module__ = "fxckpt"


class _SegmentCall:
    """The recompute context of one checkpointed call; re-entrant (``retain_graph`` recomputes again).

    The buffers a segment writes are named by the planner (``segment._fxckpt_restores``, from
    the ops it saw write them); version counters cannot tell, since kernels such as
    ``native_batch_norm`` update running statistics without bumping them.
    """

    def __init__(self, segment: torch.nn.Module) -> None:
        self.segment = segment
        self.name = getattr(segment, "_fxckpt_name", type(segment).__name__)
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.first: list | None = None

    def run(self, *inputs: Any) -> Any:
        out = self.segment(*inputs)
        meta = _metadata(out)
        if self.first is None:
            self.first = meta
        elif meta != self.first:
            bad = next(i for i, (a, b) in enumerate(zip(meta + [None], self.first + [None])) if a != b)
            raise RecomputeMismatchError(
                f"recomputing {self.name} produced tensors unlike its first run: output {bad} was "
                f"{_show(self.first, bad)} and is now {_show(meta, bad)}; recomputed code must do the "
                "same thing twice (no Python state that changes between calls)"
            )
        return out

    def contexts(self) -> tuple[contextlib.AbstractContextManager, "_SegmentCall"]:
        return contextlib.nullcontext(), self

    def __enter__(self) -> None:
        log.debug("recomputing %s", self.name)
        buffers = [self.segment.get_buffer(n) for n in getattr(self.segment, "_fxckpt_restores", ())]
        self.saved = [(b, b.detach().clone()) for b in buffers]
        _local.depth = getattr(_local, "depth", 0) + 1

    def __exit__(self, kind: Any, error: Any, tb: Any) -> None:
        _local.depth -= 1
        with torch.no_grad():
            for b, value in self.saved:
                b.copy_(value)
        self.saved = []
        if isinstance(error, torch_checkpoint.CheckpointError):
            raise RecomputeMismatchError(
                f"recomputing {self.name} produced tensors unlike its first run; recomputed code "
                f"must do the same thing twice (same shapes, dtypes and control flow).\n{error}"
            ) from error


def _metadata(out: Any) -> list:
    leaves = out if isinstance(out, tuple) else (out,)
    return [(tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else type(t) for t in leaves]


def _show(meta: list, i: int) -> str:
    if i >= len(meta):
        return "missing"
    m = meta[i]
    return f"shape {list(m[0])} {m[1]} on {m[2]}" if isinstance(m, tuple) else m.__name__
