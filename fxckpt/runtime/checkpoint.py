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
from typing import Any, Iterator

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
        segment,
        *inputs,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=call.contexts,
        determinism_check="default",
    )


# Generated code reads `fxckpt_checkpoint(segment_0, x)`; `fxckpt.checkpoint` is the public name.
checkpoint.__module__ = "fxckpt"


class _SegmentCall:
    """What one checkpointed call needs at recompute time.

    The buffers a segment writes are named by the planner (``segment._fxckpt_restores``, from
    the ops it saw write them); version counters cannot tell, since kernels such as
    ``native_batch_norm`` update running statistics without bumping them.
    """

    def __init__(self, segment: torch.nn.Module) -> None:
        self.segment = segment
        self.name = getattr(segment, "_fxckpt_name", type(segment).__name__)

    def contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        return contextlib.nullcontext(), self._recompute()

    @contextlib.contextmanager
    def _recompute(self) -> Iterator[None]:
        log.debug("recomputing %s", self.name)
        self.written = [self.segment.get_buffer(n) for n in getattr(self.segment, "_fxckpt_restores", ())]
        saved = [b.detach().clone() for b in self.written]
        _local.depth = getattr(_local, "depth", 0) + 1
        try:
            yield
        except torch_checkpoint.CheckpointError as e:
            raise RecomputeMismatchError(
                f"recomputing {self.name} produced tensors unlike its first run; recomputed code "
                f"must do the same thing twice (same shapes, dtypes and control flow).\n{e}"
            ) from e
        finally:
            _local.depth -= 1
            with torch.no_grad():
                for b, s in zip(self.written, saved):
                    b.copy_(s)
