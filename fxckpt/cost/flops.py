"""Counting FLOPs: torch's counter, taught the attention kernels it misses.

``torch.utils.flop_counter`` has formulas for the CUDA attention kernels (flash, efficient,
cuDNN) but none for the one CPU runs, ``_scaled_dot_product_flash_attention_for_cpu``: it counted
0 FLOPs for every attention call on CPU, so the solver took attention for a cheap, memory-bound
op (16 FLOP-equivalents per byte it writes) and recomputed it where it should have kept it. On
the Llama-style benchmark model (width 128, 128 tokens) one call runs about 0.8 ms, about 18x
what its output's bytes priced. :func:`counter` adds the CPU kernel and its backward with
torch's own formulas (two batched matmuls forward, five backward; grouped-query attention
included).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.flop_counter import (FlopCounterMode, _FlopCounterMode, sdpa_backward_flop_count,
                                      sdpa_flop_count)

__all__ = ["counter", "EXTRA_FORMULAS"]

aten = torch.ops.aten


def _forward(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None,
             **kwargs: Any) -> int:
    """Shapes in (torch's counter passes shapes), FLOPs out; causal masking is not discounted,
    as torch does not for the CUDA kernels."""
    return int(sdpa_flop_count(query, key, value))


def _backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any,
              out_shape: Any = None, **kwargs: Any) -> int:
    return int(sdpa_backward_flop_count(grad_out, query, key, value))


def _extra() -> dict[Any, Callable[..., int]]:
    found: dict[Any, Callable[..., int]] = {}
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward is not None:
        found[forward] = _forward
    if backward is not None:
        found[backward] = _backward
    return found


EXTRA_FORMULAS = _extra()
"""Formulas torch's counter lacks, keyed by op packet (empty where the op does not exist)."""


class _Counter(FlopCounterMode):
    """torch's counter without its per-module breakdown: that tracks modules with *global*
    module hooks, which would fire in every other thread's models while fxckpt plans (and make
    a capture there see global hooks). The total, all fxckpt reads, is counted the same way."""

    def __enter__(self) -> "_Counter":
        self.flop_counts.clear()
        self.mode = _FlopCounterMode(self)
        self.mode.__enter__()
        return self

    def __exit__(self, *args: Any) -> Any:
        mode, self.mode = self.mode, None
        return mode.__exit__(*args) if mode is not None else None


def counter() -> FlopCounterMode:
    """A silent FLOP counter (no global hooks) that also counts CPU attention."""
    return _Counter(display=False, custom_mapping=dict(EXTRA_FORMULAS))
