"""Aten calls by what decides their speed, made again to be timed on this CPU.

A price per byte, measured on one contiguous 1 MiB tensor, says little about the calls a model
makes. On the bench Llama the forward's ``mul`` calls took 2.8x their per-byte price (broadcast
operands, transposed heads), ``add`` 3.6x, and its matmuls 1.5x their FLOPs at the rate of a
1024 x 1024 matmul; the CPU's convolution backward ran at a seventh of that rate. So every call
a graph makes on the CPU gets a key of its own: the op overload, each tensor argument's shape,
strides, dtype and whether autograd records the call, and every other argument. :func:`key`
writes it and keeps what is needed to make the call again; :func:`timed` makes it on random
inputs of the same layout and times it, for :class:`fxckpt.cost.cpu_table.MeasuredTable`. A
graph of repeated blocks has few distinct keys (GPT-2's twelve layers make the same 58 calls):
each is timed once per process.

A call whose arguments cannot be made again (a non-CPU tensor, a value not a literal) has no
key, nor has a call that draws random numbers (timing it would draw from torch's generator and
change the model's dropout masks): those are priced per byte as before. The table
(``device_profile="cpu"``) prices a key by the call's own terms.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["key", "timed", "fastest_pass", "known", "terms_of", "flops_of", "PREFIX",
           "MAX_CALLS"]

PREFIX = "timed:"

_CALLS: dict[str, tuple[Any, Any, tuple[tuple[str, float], ...], float]] = {}
"""Key -> (the op, the arguments as specs, the call's terms at the table's prices, its
FLOPs)."""

_LITERALS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
             torch.memory_format)

_COLD_BYTES = 16 << 20
"""Inputs of a timed call, copied until they fill this many bytes (at most :data:`_COPIES`
copies), are used in turn: read from memory, not from the cache, as a model's are."""
_COPIES = 32

MAX_CALLS = 50_000
"""Distinct calls a process keeps, at most (about 1 KiB each); later ones have no key."""

_SLOW = 0.05
"""Seconds of a warm-up pass past which one timed pass follows, not ``repeats``."""


class _TensorSpec(tuple):
    """(shape, strides, dtype, requires_grad) of a tensor argument."""

    def __repr__(self) -> str:
        return "T" + tuple.__repr__(self)


def _spec(value: Any, recorded: bool) -> Any:
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.is_sparse or value.is_quantized:
            raise ValueError("only dense CPU tensors are made again")
        if any(isinstance(d, torch.SymInt) for d in (*value.shape, *value.stride())):
            raise ValueError("symbolic sizes are not made again")
        return _TensorSpec((tuple(int(d) for d in value.shape),
                            tuple(int(s) for s in value.stride()), value.dtype,
                            recorded and bool(value.requires_grad)))
    if isinstance(value, (list, tuple)):
        return type(value)(_spec(v, recorded) for v in value)
    if isinstance(value, _LITERALS):
        return value
    raise ValueError(f"{type(value).__name__} is not made again")


def key(func: Any, args: tuple, kwargs: dict, out: Any,
        terms: tuple[tuple[str, float], ...]) -> Optional[str]:
    """The key of this CPU call (kept for :func:`timed` with ``terms``, its price at the
    table, and its FLOPs), or ``None`` when it cannot be made again or draws random numbers
    (timing it would draw from torch's generator: priced per byte)."""
    if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
        return None
    recorded = torch.is_grad_enabled()  # autograd records it (not in a backward pass)
    try:
        spec = (_spec(tuple(args), recorded), {k: _spec(v, recorded) for k, v in kwargs.items()})
    except (ValueError, TypeError, RuntimeError):
        return None
    text = PREFIX + f"{func}{spec!r}"
    if text not in _CALLS:
        if len(_CALLS) >= MAX_CALLS:  # a process that planned very many shapes: per byte now
            return None
        _CALLS[text] = (func, spec, terms, _flops(func, args, kwargs, out))
    return text


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    """The call's FLOPs, by torch's formulas and fxckpt's (as annotate counts them)."""
    formula = _formulas().get(func.overloadpacket)
    return 0.0 if formula is None else float(formula(*args, **kwargs, out_val=out))


@functools.cache
def _formulas() -> dict[Any, Any]:
    from fxckpt.cost.flops import counter

    return dict(counter().flop_registry)


def flops_of(text: str) -> float:
    """The FLOPs of the call ``text`` names (the node's FLOPs count them already)."""
    return _CALLS[text][3]


def known(text: str) -> bool:
    """Whether this process can make the call ``text`` names again."""
    return text in _CALLS


def terms_of(text: str) -> tuple[tuple[str, float], ...]:
    """The call's terms at the table's prices (what prices it when it cannot be timed)."""
    return _CALLS[text][2]


def _made(spec: Any) -> Any:
    if isinstance(spec, _TensorSpec):
        shape, stride, dtype, grad = spec
        size = sum((s - 1) * st for s, st in zip(shape, stride)) + 1 if all(shape) else 0
        base = torch.empty(size, dtype=dtype)
        if dtype.is_floating_point or dtype.is_complex:
            base.uniform_(0.5, 1.5, generator=_generator())  # positive: log and rsqrt finite
        elif dtype == torch.bool:
            base.fill_(True)
        else:
            base.zero_()  # indices in range of any dimension
        if grad:  # an activation autograd records the call on (not a leaf: in-place calls pass)
            base = base.requires_grad_().clone()
        return base.as_strided(shape, stride)
    if isinstance(spec, dict):
        return {k: _made(v) for k, v in spec.items()}
    if isinstance(spec, (list, tuple)):
        return type(spec)(_made(v) for v in spec)
    return spec


@functools.cache
def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _nbytes(values: Any) -> int:
    return sum(t.untyped_storage().nbytes() for t in pytree.tree_leaves(values)
               if isinstance(t, torch.Tensor))


def timed(text: str, repeats: int = 3) -> float:
    """Seconds the call ``text`` names takes here: :func:`fastest_pass` over copies of its
    inputs (read from memory, :data:`_COLD_BYTES`). Inputs
    that required grad where the call was seen require it again, so autograd records the call
    as a training forward's. Inputs are drawn from a generator of this module's own, and no
    call that draws random numbers has a key: torch's generators are never drawn from. No
    dispatch mode that is active sees the calls (a FLOP counter around the step that plans).
    Raises what the call raises."""
    func, (args_spec, kwargs_spec), _, _ = _CALLS[text]
    with _disable_current_modes(), torch.enable_grad():
        first = (_made(args_spec), _made(kwargs_spec))
        copies = max(1, min(_COPIES, _COLD_BYTES // max(1, _nbytes(first))))
        inputs = [first] + [(_made(args_spec), _made(kwargs_spec)) for _ in range(copies - 1)]
        return fastest_pass([functools.partial(func, *args, **kwargs)
                             for args, kwargs in inputs], repeats)


def fastest_pass(calls: list[Callable[[], object]], repeats: int = 3) -> float:
    """Seconds of one of ``calls``: the fastest of ``repeats`` timed passes over all of them,
    after a warm-up pass (one timed pass after a warm-up longer than :data:`_SLOW`: a long call
    varies little).

    Outputs stay alive through the pass after their own, as a training forward's stay alive:
    each is written to memory the allocator already holds, neither in the cache (as an output
    freed at once would be, then written again where it was) nor fresh from the system. Freed
    at the end of their own pass, as earlier versions did, a pass's outputs let glibc give the
    heap back to the system in some processes and not in others, and there every output was
    written to new pages, a fault per 4 KiB: a 1 MiB ``mul`` took 35 us in one process and 450
    in the next, and the plans followed. Held one pass longer, the next pass's outputs take the
    memory of the pass before. A pass that faulted pages does not count while a later one
    does not (:data:`_SETTLE`)."""
    best, clean, passes, extra, i = math.inf, math.inf, repeats + 1, 0, 0
    held: list[object] = []
    while i < passes:
        kept = []
        faults = _page_faults()
        start = time.perf_counter()
        for call in calls:
            kept.append(call())
        seconds = time.perf_counter() - start
        faulted = _page_faults() > faults
        if i:
            best = min(best, seconds / len(calls))
            if not faulted:
                clean = min(clean, seconds / len(calls))
        elif seconds > _SLOW:
            passes = 2
        if i and faulted and passes > 2 and extra < _SETTLE:
            passes, extra = passes + 1, extra + 1
        held = kept  # the pass before is freed now; this one lives through the next
        i += 1
    del held
    return clean if clean < math.inf else best


_SETTLE = 8
"""Passes :func:`fastest_pass` adds, at most, while passes fault pages: outputs larger than
glibc's mmap threshold are mapped afresh until the threshold has grown past them and the heap
holds two passes' outputs (an 8 MiB ``mul``: 3.2 ms a call for six passes, then 0.37 ms), as a
training loop's first steps fault and the next ones do not."""


def _page_faults() -> int:
    """Minor page faults of this thread so far (0 where the platform does not count them)."""
    try:
        import resource
    except ImportError:  # not a Unix
        return 0
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    return resource.getrusage(who).ru_minflt


def _call(text: str) -> Callable[[], object]:
    """The call ``text`` names, once, on fresh inputs (for tests)."""
    func, (args_spec, kwargs_spec), _, _ = _CALLS[text]
    args, kwargs = _made(args_spec), _made(kwargs_spec)
    return lambda: func(*args, **kwargs)
