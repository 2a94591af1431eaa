"""Attention as a GPU runs it, for plans made on the meta device for a GPU.

On the meta device (and the CPU) ``scaled_dot_product_attention`` runs as its math: a batched
matmul, a softmax over ``[batch, heads, L, S]`` and a second matmul, whose backward keeps the
attention probabilities (at sequence 4096, 32 heads, bf16: 1 GiB a layer). A GPU runs one fused
kernel instead (flash attention without a mask, memory-efficient attention with one) that keeps
only the output and a log-sum-exp per row, and costs its FLOPs, not the traffic of an
``L x S`` matrix. A plan made on the meta device for a GPU profile (``device_profile="h100"``)
that priced the math would overstate every attention's memory and recompute, and a hand policy
that keeps attention outputs could not be compared with the solver's plans.

:func:`fused_attention` is a torch function mode that, while it is active, sends every
``scaled_dot_product_attention`` call (``F.scaled_dot_product_attention`` in a traced graph, the
aten op in an exported one) to the fused kernel's aten op, whose meta kernel and autograd formula
give the shapes, the saved tensors and the FLOPs a GPU step has. Annotation and verification of
such a plan run under it (:func:`fxckpt.serve.whole_graph`); nothing else does, and a real GPU
picks the fused kernel itself.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.torch_version import TorchVersion

from fxckpt.cost.devices import PROFILES

__all__ = ["fused_attention", "plans_fused", "no_dropout"]

_SDPA = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default,
         torch.ops.aten.scaled_dot_product_attention)
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False,
                             "scale": None, "enable_gqa": False}


def plans_fused(profile: Optional[str], device: str) -> bool:
    """Is a plan for ``profile`` (a ``device_profile`` name) made on ``device`` one whose
    attention should be the GPU's fused kernel? Only on the meta device, for a GPU profile, and
    from torch 2.13 (:data:`SINCE`)."""
    return (device == "meta" and profile is not None and PROFILES.get(profile) is not None
            and bool(TorchVersion(torch.__version__) >= SINCE))  # type: ignore[operator]


SINCE = (2, 13)
"""On torch 2.11 a planning step of a meta Llama under this mode reached a ``Tensor.item()`` on a
meta tensor (not yet traced to its op): there plans keep the math attention."""


class _Fused(TorchFunctionMode):
    replayed_in_recompute = True
    """Entered again for a segment's recompute (:data:`fxckpt.runtime.checkpoint.REPLAYED`):
    the recompute must run the kernel the first run ran."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func not in _SDPA:
            return func(*args, **kwargs)
        call = dict(_DEFAULTS, **dict(zip(_NAMES, args)), **kwargs)
        q, k, v, mask = call["query"], call["key"], call["value"], call["attn_mask"]
        if not all(t.device.type == "meta" for t in (q, k, v)):
            return func(*args, **kwargs)
        # The fused kernels take grouped key/value heads as they are (enable_gqa or not).
        if mask is None:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, call["dropout_p"], call["is_causal"], False, scale=call["scale"])[0]
        if mask.dtype == torch.bool:  # the kernel adds a float bias, as sdpa converts it
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=mask.device)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, True, call["dropout_p"], call["is_causal"], scale=call["scale"])[0]


@contextlib.contextmanager
def fused_attention(active: bool = True) -> Iterator[None]:
    """While active, attention on meta tensors runs as the GPU's fused kernel (module
    docstring); ``active=False``: as it is."""
    if not active:
        yield
        return
    with _Fused():
        yield


_SEEDED_ATTENTION = ("_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_efficient_attention",
                     "_scaled_dot_product_cudnn_attention")


def no_dropout(func: Any, args: tuple, kwargs: dict) -> bool:
    """A fused attention kernel (tagged as seeded: it may drop out) called with no dropout
    draws nothing."""
    if func.overloadpacket.__name__ not in _SEEDED_ATTENTION:
        return False
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p":
            value = kwargs.get("dropout_p", args[i] if i < len(args) else 0.0)
            return value == 0.0
    return False
