"""Matmul, convolution and attention calls by their shapes: keys a CPU's measured prices time.

A CPU runs a matmul at its peak rate only at large, square shapes. The bench models' matmuls
(a batch of 512 rows against a 256-wide weight, attention's small batched products) and their
convolutions run at 0.3-0.9 of a 1024 x 1024 matmul's FLOP/s, and the backward's transposed
products slower again. Pricing every FLOP alike put a forward pass at half its measured time.

So each such call gets a price term of its own, keyed by what decides its speed: the op, each
tensor's shape and whether it is laid out transposed, the dtype, and a convolution's or the
fused attention's parameters (the CPU's attention kernel ran at 0.15-0.5 of the matmul's rate
per FLOP). :func:`key` writes the key; :func:`timed_call` makes the call again from it, on
random inputs, for :class:`fxckpt.cost.cpu_table.MeasuredTable` to time. The term's amount is
the call's FLOPs, and its price the call's time per FLOP beyond one FLOP-equivalent: the
table (``device_profile="cpu"``) prices it at 0, every FLOP alike, as before.
"""

from __future__ import annotations

import ast
from typing import Any, Callable, Optional

import torch
from torch.utils.flop_counter import conv_flop_count, sdpa_flop_count

__all__ = ["key", "flops_of", "timed_call", "conv_out", "PREFIX", "ATTENTION"]

aten = torch.ops.aten

PREFIX = "kernel:"

_MATMULS = {"mm": 0, "addmm": 1, "bmm": 0, "baddbmm": 1}
"""Matmul ops, by how many leading arguments come before the two factors."""

ATTENTION = "_scaled_dot_product_flash_attention_for_cpu"
"""The CPU's fused attention kernel (the table prices its FLOPs at
:data:`~fxckpt.cost.prices.CPU_ATTENTION_FACTOR`)."""


def _layout(t: torch.Tensor) -> tuple[tuple[int, ...], bool]:
    """A tensor's shape, and whether its last two dimensions are laid out transposed."""
    shape = tuple(int(d) for d in t.shape)
    transposed = (t.dim() >= 2 and not t.is_contiguous()
                  and t.transpose(-1, -2).is_contiguous())
    return shape, transposed


def _matmul_flops(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    batch = a[0] if len(a) == 3 else 1
    return 2 * batch * a[-2] * a[-1] * b[-1]


def key(func: Any, args: tuple, kwargs: dict) -> Optional[tuple[str, float]]:
    """``(key, FLOPs)`` of a CPU matmul or convolution call with these arguments, or ``None``
    for any other call (or one whose shapes are not plain integers)."""
    name = func.overloadpacket.__name__
    try:
        if name in _MATMULS:
            lead = _MATMULS[name]
            spec = (name, tuple(_layout(t) for t in args[:lead + 2]), str(args[lead].dtype), ())
        elif name == "convolution":
            spec = (name, (_layout(args[0]), _layout(args[1])), str(args[0].dtype),
                    (args[2] is not None, *(_plain(a) for a in args[3:9])))
        elif name == ATTENTION:
            if kwargs.get("attn_mask") is not None:
                return None
            dropout = float(args[3]) if len(args) > 3 else float(kwargs.get("dropout_p", 0.0))
            causal = bool(args[4]) if len(args) > 4 else bool(kwargs.get("is_causal", False))
            scale = kwargs.get("scale")
            spec = (name, tuple(_layout(t) for t in args[:3]), str(args[0].dtype),
                    (dropout, causal, None if scale is None else float(scale)))
        elif name == "convolution_backward":
            spec = (name, tuple(_layout(t) for t in args[:3]), str(args[0].dtype),
                    tuple(_plain(a) for a in args[3:11]))
        else:
            return None
        text = PREFIX + repr(spec)
        return text, float(flops_of(text))
    except (TypeError, ValueError, IndexError, AttributeError):
        return None  # symbolic sizes, or arguments of another form


def flops_of(text: str) -> int:
    """The FLOPs of the call ``text`` (a :func:`key`) names."""
    name, layouts, _, extra = ast.literal_eval(text[len(PREFIX):])
    shapes = [shape for shape, _ in layouts]
    if name in _MATMULS:
        lead = _MATMULS[name]
        return _matmul_flops(shapes[lead], shapes[lead + 1])
    if name == ATTENTION:
        return int(sdpa_flop_count(*shapes))
    if name == "convolution":
        x, w = shapes
        out = conv_out(x, w, *extra[1:])
        return int(conv_flop_count(list(x), list(w), list(out), bool(extra[4])))
    g, x, w = shapes  # convolution_backward: each gradient asked for is a forward's size
    mask, transposed = extra[-1], bool(extra[4])
    forward = conv_flop_count(list(x), list(w), list(g), transposed)
    return int(forward * (bool(mask[0]) + bool(mask[1])))


def _plain(value: Any) -> Any:
    """Lists as tuples of ints, ints and bools as themselves (a key must be a literal)."""
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if value is None or isinstance(value, bool):
        return value
    return int(value)


def conv_out(x: tuple[int, ...], w: tuple[int, ...], stride: tuple[int, ...],
             padding: tuple[int, ...], dilation: tuple[int, ...], transposed: bool,
             output_padding: tuple[int, ...], groups: int) -> tuple[int, ...]:
    """The output shape of a (non-transposed) convolution; a transposed one's from its input."""
    spatial = []
    for i, size in enumerate(x[2:]):
        k = dilation[i] * (w[2 + i] - 1) + 1
        if transposed:
            spatial.append((size - 1) * stride[i] - 2 * padding[i] + k + output_padding[i])
        else:
            spatial.append((size + 2 * padding[i] - k) // stride[i] + 1)
    channels = w[1] * groups if transposed else w[0]
    return (x[0], channels, *spatial)


def _tensor(layout: tuple[tuple[int, ...], bool], dtype: torch.dtype) -> torch.Tensor:
    shape, transposed = layout
    if not transposed:
        return torch.rand(shape, dtype=dtype)
    swapped = (*shape[:-2], shape[-1], shape[-2])
    return torch.rand(swapped, dtype=dtype).transpose(-1, -2)


def timed_call(text: str) -> Callable[[], object]:
    """The call ``text`` (a :func:`key`) names, on random inputs of its shapes and layouts."""
    name, layouts, dtype_name, extra = ast.literal_eval(text[len(PREFIX):])
    dtype = getattr(torch, dtype_name.removeprefix("torch."))
    ts = [_tensor(layout, dtype) for layout in layouts]
    if name in ("mm", "bmm"):
        op = aten.mm if name == "mm" else aten.bmm
        return lambda: op(ts[0], ts[1])
    if name in ("addmm", "baddbmm"):
        op2 = aten.addmm if name == "addmm" else aten.baddbmm
        return lambda: op2(ts[0], ts[1], ts[2])
    if name == ATTENTION:
        dropout, causal, scale = extra
        return lambda: aten._scaled_dot_product_flash_attention_for_cpu(
            ts[0], ts[1], ts[2], dropout, causal, scale=scale)
    if name == "convolution":
        bias_on, *rest = extra
        bias = torch.rand(layouts[1][0][0], dtype=dtype) if bias_on else None
        return lambda: aten.convolution(ts[0], ts[1], bias, *rest)
    return lambda: aten.convolution_backward(ts[0], ts[1], ts[2], *extra)
