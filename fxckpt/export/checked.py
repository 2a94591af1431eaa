"""ATen operators whose kernels trust their arguments, called by loaded graphs through a check.

Fuzzing every operator of the allowlist with forged arguments (``tests/export/test_fuzz_ops.py``)
found kernels that read out of bounds when their arguments disagree. Where real models need such
an operator (``aten._weight_norm``: every Hugging Face speech model's positional convolution), a
loaded graph calls it through the check its kernel lacks, under the operator's own name in the
generated code; anywhere else the operator leaves the allowlist.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["CHECKED", "weight_norm"]


def weight_norm(v: torch.Tensor, g: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``aten._weight_norm(v, g, dim)``, once ``g`` has the shape its kernel reads: ``v``'s size
    along ``dim`` and 1 elsewhere (one element when ``dim`` is -1). The kernel reads ``g`` by
    ``v``'s geometry: an empty ``g`` crashed the process."""
    if not (isinstance(v, torch.Tensor) and isinstance(g, torch.Tensor)
            and type(dim) is int):
        raise TypeError("_weight_norm(v, g, dim) takes two tensors and an int")
    if dim == -1:
        ok = g.numel() == 1
    else:
        if not -v.dim() <= dim < v.dim():
            raise IndexError(f"_weight_norm: dim {dim} is out of range for {v.dim()} dimensions")
        dim %= v.dim()
        expected = [v.size(i) if i == dim else 1 for i in range(v.dim())]
        ok = list(g.shape) == expected
    if not ok or g.dtype != v.dtype or g.device != v.device:
        raise ValueError(f"_weight_norm: g of shape {tuple(g.shape)} ({g.dtype}, {g.device}) does "
                         f"not match v of shape {tuple(v.shape)} along dim {dim}")
    return torch.ops.aten._weight_norm.default(v, g, dim)


CHECKED: dict[str, Callable[..., Any]] = {
    "torch.ops.aten._weight_norm.default": weight_norm,
}
"""Allowlist name -> the checked function a loaded graph calls in its place."""
