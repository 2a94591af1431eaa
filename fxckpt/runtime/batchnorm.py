"""Deferred batch norm: BatchNorm running statistics updated once per step, as for the whole batch.

A pipeline runs every BatchNorm layer once per micro-batch, and once more for each micro-batch it
recomputes. Left alone, ``running_mean``/``running_var`` would be updated ``chunks`` (+ recompute)
times per step with micro-batch statistics, and ``num_batches_tracked`` would count micro-batches.
torchgpipe's answer, which we follow, is to *defer* the update:

    micro-batch 0   1   2   3        forward: normalise with the micro-batch's own statistics
                |   |   |   |        (as any GPipe does); record count, mean, M2 per channel
                v   v   v   v
    commit:  mean, var of the union (Chan's parallel formula, float64)
             running_* <- (1 - m) * running_* + m * (mean, unbiased var);  num_batches_tracked += 1

so after a step the buffers are what one full-batch step would have left (up to float rounding),
and a recompute in backward (``fxckpt.runtime.is_recomputing()``) records nothing.

How: rather than swapping modules (which would mutate modules shared with the user's model, and
reach BatchNorm inside lowered checkpoint segments only with copies), a ``TorchFunctionMode``
active only while a pipeline stage runs intercepts ``F.batch_norm`` calls whose running buffers
belong to a tracked BatchNorm module, and runs them on throwaway copies of those buffers (batch
statistics, no update of the real ones; the op and what autograd saves for it stay the eager
ones, so a lowered segment recomputed in backward -- outside this mode -- matches its first run,
and its own buffer restore undoes the recompute's update). The module's own
``num_batches_tracked += 1`` still happens per micro-batch; the commit sets it to its value before
the step plus one. Graphs that call the aten batch-norm ops directly (``torch.export`` graphs) are
not intercepted: their statistics are updated once per micro-batch.

Normalisation itself uses micro-batch statistics -- that is inherent to GPipe: no full-batch
statistics exist until every micro-batch has passed the layer. Outputs and gradients of a
training step therefore equal those of the model run on each micro-batch separately.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm
from torch.overrides import TorchFunctionMode

from fxckpt.runtime.checkpoint import is_recomputing

__all__ = ["DeferredBatchNorm"]

_SIGNATURE = inspect.signature(F.batch_norm)


class DeferredBatchNorm:
    """Per-step statistics of the BatchNorm modules of some stages, committed once per step."""

    def __init__(self, modules: Iterable[torch.nn.Module]) -> None:
        self.norms: dict[int, _BatchNorm] = {}
        for m in modules:
            if isinstance(m, _BatchNorm) and m.track_running_stats and m.running_mean is not None:
                self.norms[id(m)] = m
        self.stats: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        self.counts: dict[int, torch.Tensor] = {}

    @property
    def active(self) -> bool:
        """There is at least one BatchNorm module to defer."""
        return bool(self.norms)

    def covers(self, module: torch.nn.Module) -> bool:
        """Some BatchNorm module in ``module`` is tracked (so its stage should collect)."""
        return any(id(m) in self.norms for m in module.modules())

    def begin(self) -> None:
        """Start a step: forget statistics, remember each module's ``num_batches_tracked``."""
        self.stats = {}
        self.counts = {k: m.num_batches_tracked.detach().clone()
                       for k, m in self.norms.items() if m.num_batches_tracked is not None}

    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        """While active, tracked ``F.batch_norm`` calls use batch statistics and are recorded."""
        by_buffer = {id(m.running_mean): k for k, m in self.norms.items()}
        with _Collect(self, by_buffer):
            yield

    def record(self, key: int, x: torch.Tensor) -> None:
        with torch.no_grad():
            dims = [0, *range(2, x.dim())]
            var, mean = torch.var_mean(x.detach().double(), dim=dims, correction=0)
            count = x.numel() // x.shape[1]
            self.stats.setdefault(key, []).append((count, mean, var * count))

    def commit(self) -> None:
        """Update running statistics once, as one batch of all recorded micro-batches would."""
        with torch.no_grad():
            for key, parts in self.stats.items():
                _update(self.norms[key], parts, self.counts.get(key))
        self.stats = {}

    def abort(self) -> None:
        """Drop the step's statistics (the caller restores buffers)."""
        self.stats = {}


def _update(bn: _BatchNorm, parts: list[tuple[int, torch.Tensor, torch.Tensor]],
            before: torch.Tensor | None) -> None:
    n = sum(c for c, _, _ in parts)
    mean = torch.stack([c * mu for c, mu, _ in parts]).sum(0) / n
    m2 = torch.stack([m2_i + c * (mu - mean) ** 2 for c, mu, m2_i in parts]).sum(0)
    var = m2 / max(n - 1, 1)
    if before is not None and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.copy_(before + 1)
    if bn.momentum is None:  # cumulative moving average, as nn.BatchNorm does
        factor = 1.0 / float(before + 1) if before is not None else 0.0
    else:
        factor = bn.momentum
    for buf, value in ((bn.running_mean, mean), (bn.running_var, var)):
        if buf is not None:
            buf.mul_(1.0 - factor).add_(value.to(buf.dtype), alpha=factor)


class _Collect(TorchFunctionMode):
    def __init__(self, owner: DeferredBatchNorm, by_buffer: dict[int, int]) -> None:
        super().__init__()
        self.owner, self.by_buffer = owner, by_buffer

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.batch_norm:
            return func(*args, **kwargs)
        bound = _SIGNATURE.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        key = self.by_buffer.get(id(a["running_mean"])) if a["running_mean"] is not None else None
        if key is None or not a["training"]:
            return func(*args, **kwargs)
        if not is_recomputing():
            self.owner.record(key, a["input"])
        # Throwaway copies of the running buffers take the update: the op (and what autograd saves
        # for it) is the eager one, so a segment recomputed outside this mode matches its first
        # run.
        running = (
            a["running_mean"].clone(),
            a["running_var"].clone() if a["running_var"] is not None else None,
        )
        return F.batch_norm(
            a["input"], *running, a["weight"], a["bias"], True, a["momentum"], a["eps"]
        )
