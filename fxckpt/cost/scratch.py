"""Scratch: memory a kernel allocates for itself while it runs, beyond its inputs and outputs.

fxckpt counts tensors at the dispatcher (:class:`~fxckpt.measure.LiveTensorTracker`): every
storage an aten op returns. Buffers a kernel allocates inside and frees before it returns are not
tensors anyone sees. For most ops they are small; for convolution on the CPU they are not. oneDNN
(``mkldnn``, what PyTorch runs for float convolutions on the CPU) works in a blocked layout, and
for a plain NCHW tensor it reorders the input and output into scratch buffers as large as they
are. On a ResNet-style CNN (batch 16, 32 channels, 32x32) a plan whose tracked tensors fit a
28.0 MiB budget peaked at 32.2 MiB resident, the 4.2 MiB held by one ``convolution_backward``.

So the byte counts here are *measured* (resident memory of a single call, glibc serving each
block with its own ``mmap``; torch 2.13, CPU; ``tests/cost/test_scratch.py`` measures them again):

========================  ====================================  ==================================
kernel                    forward                               backward
========================  ====================================  ==================================
oneDNN, NCHW input        max(input, output) + weight           input + output (input twice when
                                                                strided); only the input gradient:
                                                                max(input, output)
oneDNN, transposed        2 x max(input, output)                as above
oneDNN, channels-last     0 (works on the tensors themselves)   0
im2col (``Slow2d``...)    the columns: batch x C x kernel x     the same
                          output positions (input positions
                          when transposed)
anything else             0                                     0
========================  ====================================  ==================================

Channels-last models therefore pay no scratch; a NCHW CNN pays about one or two activations of
the layer being run. CUDA's cuDNN workspace comes from the caching allocator and is not counted
here (its size depends on the algorithm cuDNN picks at run time).

The verifier adds a call's scratch to what is alive while it runs; annotate records, for every
node, the most its calls and their backward allocate (:attr:`NodeInfo.scratch`), and the
simulator's reserve covers the largest (:attr:`fxckpt.solver.Problem.reserve_bytes`).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

__all__ = ["call_scratch", "backward_scratch"]

_CONV = torch.ops.aten.convolution.default
_CONV_BACKWARD = torch.ops.aten.convolution_backward.default

_BACKENDS = getattr(torch._C, "_ConvBackend", None)
_MKLDNN = int(_BACKENDS.Mkldnn) if _BACKENDS is not None else -1
# MkldnnTranspose follows Mkldnn in ATen's ConvBackend and has no name in the Python enum.
_MKLDNN_TRANSPOSE = _MKLDNN + 1
_IM2COL = {int(getattr(_BACKENDS, name)) for name in (
    "Slow2d", "Slow3d", "SlowDilated2d", "SlowDilated3d", "SlowTranspose2d", "SlowTranspose3d",
) if hasattr(_BACKENDS, name)}


def call_scratch(func: Any, args: Sequence[Any], kwargs: Optional[dict] = None) -> int:
    """Bytes the kernel of the aten call ``func(*args, **kwargs)`` allocates for itself."""
    try:
        if func is _CONV:
            conv = _Conv(_conv_args(args, kwargs, _FORWARD))
            return conv.forward()
        if func is _CONV_BACKWARD:
            given = _conv_args(args, kwargs, _BACKWARD)
            conv = _Conv(given[1:10], out_shape=tuple(given[0].shape))
            return conv.backward(given[10])
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError):
        return 0  # symbolic shapes (sizing them would add guards), arguments it cannot read
    return 0


def backward_scratch(func: Any, args: Sequence[Any], kwargs: Optional[dict] = None) -> int:
    """Bytes the backward kernel of the aten call ``func(*args, **kwargs)`` allocates for itself
    (every gradient asked for, the most it can be)."""
    try:
        if func is _CONV:
            conv = _Conv(_conv_args(args, kwargs, _FORWARD))
            return conv.backward((True, True, False))
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError):
        return 0
    return 0


_FORWARD = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed",
            "output_padding", "groups")
_BACKWARD = ("grad_output", "input", "weight", "bias_sizes", "stride", "padding", "dilation",
             "transposed", "output_padding", "groups", "output_mask")


def _conv_args(args: Sequence[Any], kwargs: Optional[dict], names: Sequence[str]) -> list[Any]:
    kwargs = kwargs or {}
    return [args[i] if i < len(args) else kwargs[name] for i, name in enumerate(names)]


class _Conv:
    """One convolution call's shapes and the kernel PyTorch picks for it."""

    def __init__(self, given: Sequence[Any], out_shape: Optional[tuple[int, ...]] = None) -> None:
        """``given``: ``convolution``'s arguments (a backward's ``bias_sizes`` as the bias)."""
        x, w, bias, stride, padding, dilation, transposed, output_padding, groups = given
        if _symbolic(x) or _symbolic(w):
            raise TypeError("symbolic shapes")  # sizing them would guard on them
        self.x, self.w, self.transposed = x, w, bool(transposed)
        self.stride, self.padding = [int(s) for s in stride], [int(p) for p in padding]
        self.backend = -1
        if x.device.type == "cpu" and _BACKENDS is not None:
            bias_t = bias if isinstance(bias, torch.Tensor) else None
            self.backend = _code(torch._C._select_conv_backend(
                x, w, bias_t, list(stride), list(padding), list(dilation), bool(transposed),
                list(output_padding), int(groups), None))
        self.out_shape = out_shape or _out_shape(x, w, self.stride, self.padding,
                                                 [int(d) for d in dilation], self.transposed,
                                                 [int(o) for o in output_padding], int(groups))
        size = x.element_size()
        self.input, self.weight = _numel(x.shape) * size, _numel(w.shape) * size
        self.output = _numel(self.out_shape) * size

    def forward(self) -> int:
        if self.backend in (_MKLDNN, _MKLDNN_TRANSPOSE):
            if self._channels_last():
                return 0
            larger = max(self.input, self.output)
            return 2 * larger if self.transposed else larger + self.weight
        if self.backend in _IM2COL:
            return self._columns()
        return 0

    def backward(self, mask: Sequence[bool]) -> int:
        if self.backend in (_MKLDNN, _MKLDNN_TRANSPOSE):
            if self._channels_last():
                return 0
            if mask[1]:  # the weight gradient reorders both the input and the output gradient
                both = self.input + self.output
                return max(both, 2 * self.input) if any(s > 1 for s in self.stride) else both
            return max(self.input, self.output) if mask[0] else 0
        if self.backend in _IM2COL:
            return self._columns()
        return 0

    def _channels_last(self) -> bool:
        fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(self.x.dim())
        return fmt is not None and any(
            t.is_contiguous(memory_format=fmt) and not t.is_contiguous() for t in (self.x, self.w))

    def _columns(self) -> int:
        """im2col's buffer: one column per output position (input position when transposed)."""
        kernel = _numel(self.w.shape[2:])
        if not self.transposed and kernel == 1 and all(s == 1 for s in self.stride) \
                and not any(self.padding):
            return 0  # a 1x1 convolution is a plain matrix multiply
        batch = int(self.x.shape[0])
        if self.transposed:
            channels, positions = int(self.w.shape[1]), _numel(self.x.shape[2:])
        else:
            channels, positions = int(self.x.shape[1]), _numel(self.out_shape[2:])
        return batch * channels * kernel * positions * self.x.element_size()


def _out_shape(x: torch.Tensor, w: torch.Tensor, stride: list[int], padding: list[int],
               dilation: list[int], transposed: bool, output_padding: list[int],
               groups: int) -> tuple[int, ...]:
    spatial = []
    for d in range(x.dim() - 2):
        size, k = int(x.shape[d + 2]), int(w.shape[d + 2])
        if transposed:
            spatial.append((size - 1) * stride[d] - 2 * padding[d] + dilation[d] * (k - 1)
                           + output_padding[d] + 1)
        else:
            spatial.append((size + 2 * padding[d] - dilation[d] * (k - 1) - 1) // stride[d] + 1)
    channels = int(w.shape[1]) * groups if transposed else int(w.shape[0])
    return (int(x.shape[0]), channels, *spatial)


def _code(backend: Any) -> int:
    return int(backend)


def _symbolic(t: torch.Tensor) -> bool:
    return any(isinstance(s, torch.SymInt) for s in (*t.shape, *t.stride()))


def _numel(shape: Sequence[Any]) -> int:
    return math.prod(int(s) for s in shape)
