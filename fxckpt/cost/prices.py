"""What an aten call costs in time, in FLOP-equivalents, when FLOPs do not say.

The solver weighs recomputation in FLOP-equivalents: a matmul, convolution or attention kernel
costs its FLOPs (:mod:`fxckpt.cost.flops`); every other call costs the bytes it writes times a
*price per byte*, plus a fixed price per call. Annotate adds these up for each node over the aten
calls the node really runs (:func:`call_price`), so a composite op is priced by its insides:
attention with dropout on CPU runs the math path (scores, softmax, a Bernoulli draw the size of
the scores, a masked fill), about 3 ms per GPT-2 bench layer, where pricing its output alone
said 0.7 ms.

One flat price per byte was wrong by an order of magnitude either way on a CPU. Measured on the
benchmark machine (one thread, 1 MiB float32 tensors, medians of 50 calls, the matmul at
96 GFLOP/s), in FLOP-equivalents per byte written: ``mul``, ``add``, ``div``, ``relu``,
``clone``, ``cat`` 2-4; ``pow`` with an integer exponent 2.5; ``sigmoid``, ``silu``, ``rsqrt``
9-10; exact ``gelu`` 14; ``softmax`` and ``log_softmax`` 16-18; ``native_layer_norm`` 22; masked
``where`` and ``masked_fill`` 21-22; ``exp``, ``log``, ``sin``, ``erf`` 25-30; ``gelu`` with the
tanh approximation 45; ``tanh`` 62; ``_safe_softmax`` 74; ``bernoulli_`` 140 (a draw costs more
the closer its probability is to one half: :data:`EVEN`). Reductions
(``sum``, ``amax``, ``all``) are priced by the bytes they read. Devices other than the CPU keep
one price for all memory-bound calls (their kernels are bandwidth-bound) and one for random ones.

Prices are estimates for planning, not measurements of the user's machine: they decide which of
two plans recomputes less time, and a plan's peak never depends on them. Where each was measured,
and ``python -m benchmarks.calibrate`` to measure them again on another machine:
``docs/tuning.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Protocol

import torch
import torch.utils._pytree as pytree
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

from fxckpt.cost import timed_calls
from fxckpt.cost.flops import EXTRA_FORMULAS

__all__ = ["call_price", "price_terms", "call_terms", "Prices", "PriceTable", "TABLE", "traffic",
           "CALL_PRICE", "CPU_PRICES", "DEFAULT_PRICE", "RANDOM_PRICE", "EVEN",
           "OTHER_DEVICE_PRICE", "OTHER_DEVICE_RANDOM_PRICE", "REDUCTIONS", "SEGMENT_COST",
           "KEEP_COST", "SAVED_COST"]

CALL_PRICE = 2e5
"""FLOP-equivalents of one aten call's fixed cost (about 2 us of dispatch from the generated
code), whatever its size; views are left free (see :data:`ALIASES`)."""

DEFAULT_PRICE = 4.0
"""Per byte written, a CPU call with no entry in :data:`CPU_PRICES` (copies and arithmetic)."""

RANDOM_PRICE = 140.0
"""Per byte written, a CPU call that draws random numbers (``bernoulli_``: 140; ``rand`` 65)."""

EVEN = "random:even"
"""The price key of a CPU Bernoulli draw's share that depends on its probability. A draw of
probability ``p`` on the CPU costs more the closer ``p`` is to one half: its loop branches on
every draw, and the branch is guessed wrong as often as ``min(p, 1 - p)``. Measured on the
project's machine, ``bernoulli_`` takes 780 us per MiB at ``p`` = 1, 1,110 at 0.9 (a dropout of
0.1) and 2,440 at 0.5, close to linear in ``min(p, 1 - p)``. So a draw's bytes are priced
``1 - 2 min(p, 1 - p)`` at ``"random"`` (the draw alone, measured at ``p`` = 1) and the rest at
this key (measured at ``p`` = 0.5); a random call with no probability (``rand``, ``randn``) at
``"random"``. :data:`TABLE` has one price for both."""

_DRAWS = frozenset({"bernoulli", "native_dropout", "dropout", "feature_dropout"})
"""Random ops whose second argument is a probability (:data:`EVEN`)."""

OTHER_DEVICE_PRICE = 16.0
"""Per byte written, any memory-bound call on a device other than the CPU."""

OTHER_DEVICE_RANDOM_PRICE = 128.0
"""Per byte written, a random call on a device other than the CPU."""

SEGMENT_COST = 3e7
"""FLOP-equivalents of one checkpointed segment's fixed overhead: about 0.3 ms per segment per
step (forward, recompute, hooks and RNG state) measured on the benchmark machine, at 94 GFLOP/s
(``python -m benchmarks.calibrate`` measures it again: ``docs/tuning.md``)."""
KEEP_COST = 1e7
"""FLOP-equivalents of keeping one node's output in a checkpointed segment, about 100 us per step
on the benchmark machine (re-measured by ``python -m benchmarks.calibrate``): the runtime's
dispatch mode around the node in forward and in the recompute (:mod:`fxckpt.runtime.selective`)
took 30-40 us alone, and 120 us per kept node in a profiled Llama step. Keeping an op cheaper
than this would slow the step down."""
SAVED_COST = 1.5e6
"""FLOP-equivalents of each tensor an op in a checkpointed segment saves: about 16 us per step
on the benchmark machine (a segment of 160 ``sin`` calls against none, less the calls' own
price; re-measured by ``python -m benchmarks.calibrate``): the checkpoint's pack hook in forward
and in the recompute and its unpack hook in backward. On the bench GPT-2's plan at 0.75 of its
peak it raised the predicted recompute from 5% to 7% of a forward (``docs/step_time.md``)."""
CPU_PRICES: Mapping[str, float] = {
    "tanh": 62.0, "tanh_backward": 8.0,
    "exp": 27.0, "exp2": 27.0, "expm1": 27.0, "log": 25.0, "log1p": 25.0, "log2": 25.0,
    "sin": 28.0, "cos": 30.0, "erf": 29.0, "erfc": 29.0, "erfinv": 40.0, "atan": 40.0,
    "gelu": 14.0, "sigmoid": 9.0, "silu": 10.0, "mish": 40.0, "softplus": 30.0, "elu": 20.0,
    "rsqrt": 9.0, "sqrt": 9.0, "reciprocal": 4.0,
    "_softmax": 18.0, "_log_softmax": 16.0, "_safe_softmax": 74.0, "softmax": 18.0,
    "native_layer_norm": 22.0, "native_batch_norm": 16.0, "_native_batch_norm_legit": 16.0,
    "_native_batch_norm_legit_functional": 16.0, "native_group_norm": 22.0,
    "where": 22.0, "masked_fill": 21.0, "isneginf": 24.0, "isinf": 24.0, "isnan": 24.0,
    "gt": 40.0, "lt": 40.0, "ge": 40.0, "le": 40.0, "eq": 40.0, "ne": 40.0,
}
"""Per byte written, by op name, on the CPU (see the module docstring for the measurements).
``gelu`` with ``approximate="tanh"`` costs :data:`GELU_TANH_PRICE`. Comparisons write one byte per
element: their price per byte written is about four times their price per byte read."""

GELU_TANH_PRICE = 45.0

CPU_ATTENTION = frozenset(k for k in EXTRA_FORMULAS
                          if k.__name__ == "_scaled_dot_product_flash_attention_for_cpu")
"""The CPU's fused attention kernel, whose time its FLOPs understate
(:data:`CPU_ATTENTION_FACTOR`)."""

CPU_ATTENTION_FACTOR = 2.0
"""Time of the CPU's fused attention per FLOP, against a matmul's: 680 us measured for 350 us of
FLOPs at the matmul rate (the bench Llama: 4 x 4 heads of 128 tokens x 32, causal, one thread)."""

ALIASES = frozenset({"_unsafe_view", "_reshape_alias", "alias", "detach", "lift_fresh"})
"""Views torch does not mark as views. Views cost nothing here: they take about 2 us, but a node
of views only must stay free for the solver, which skips such nodes when it places cuts."""

ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty",
                         "new_empty_strided"})
"""Calls that allocate without writing: the call price only."""

FLOP_OPS = frozenset(flop_registry) | frozenset(EXTRA_FORMULAS)
"""Op packets priced by their FLOPs (torch's counter and ours): only the call price is added."""

REDUCTIONS: Mapping[str, float] = {
    "sum": 2.0, "mean": 2.0, "amax": 2.0, "amin": 2.0, "max": 2.0, "min": 2.0,
    "all": 47.0, "any": 47.0, "var": 4.0, "std": 4.0, "var_mean": 4.0, "std_mean": 4.0,
    "linalg_vector_norm": 4.0, "norm": 4.0, "logsumexp": 30.0, "argmax": 4.0, "argmin": 4.0,
}
"""Per byte *read*, on the CPU: a reduction writes little and reads much."""


def _bytes(value: Any) -> int:
    total = 0
    for t in pytree.tree_leaves(value):
        if isinstance(t, torch.Tensor):
            try:
                total += int(t.numel()) * t.element_size()
            except Exception:  # noqa: BLE001 - a data-dependent size: unknown, priced as nothing
                pass
    return total


def traffic(args: Any, kwargs: Any, out: Any) -> int:
    """Bytes a call reads (its tensor arguments) and writes (its outputs)."""
    return _bytes((args, kwargs)) + _bytes(out)


def _device(args: Any, out: Any) -> str:
    for t in pytree.tree_leaves((out, args)):
        if isinstance(t, torch.Tensor):
            return t.device.type
    return "cpu"


def price_terms(func: Any, args: tuple, kwargs: Mapping[str, Any], out: Any,
                random: bool) -> tuple[tuple[str, float], ...]:
    """What one call costs beyond its FLOPs, as ``(key, amount)`` terms a :class:`PriceTable`
    prices: ``("call", 1)``, then bytes written at an op's price (``("tanh", bytes)``), bytes read
    by a reduction (``("read:sum", bytes)``), ``("random", bytes)``, ``("gelu_tanh", bytes)``, or
    the fused CPU attention's extra FLOPs (``("attention", flops)``). Views cost nothing; an
    in-place call writes its output's bytes."""
    name = func.overloadpacket.__name__
    if getattr(func, "is_view", False) or name in ALIASES:
        return ()
    cpu = _device(args, out) == "cpu"
    if func.overloadpacket in CPU_ATTENTION and cpu:
        q, k, v = (tuple(int(d) for d in t.shape) for t in args[:3])
        return (("call", 1.0), ("attention", float(sdpa_flop_count(q, k, v))))
    if func.overloadpacket in FLOP_OPS or name in ALLOCATIONS:
        return (("call", 1.0),)
    base = name[:-1] if name.endswith("_") and not name.startswith("_") else name
    if not cpu:
        return (("call", 1.0), ("other_random" if random else "other", float(_bytes(out))))
    if random:
        return (("call", 1.0),) + _draw(base, args, kwargs, float(_bytes(out)))
    if base in REDUCTIONS:
        return (("call", 1.0), ("read:" + base, float(_bytes(args))))
    if base == "gelu" and kwargs.get("approximate", args[1] if len(args) > 1 else "none") \
            == "tanh":
        return (("call", 1.0), ("gelu_tanh", float(_bytes(out))))
    return (("call", 1.0), (base, float(_bytes(out))))


def _draw(name: str, args: tuple, kwargs: Mapping[str, Any],
          written: float) -> tuple[tuple[str, float], ...]:
    """The terms of a CPU random call's ``written`` bytes (:data:`EVEN`)."""
    p = args[1] if len(args) > 1 else kwargs.get("p")
    if name not in _DRAWS or not isinstance(p, (int, float)) or isinstance(p, bool):
        return (("random", written),)
    even = min(2 * min(float(p), 1 - float(p)), 1.0)
    if even <= 0:
        return (("random", written),)
    if even >= 1:
        return ((EVEN, written),)
    return (("random", written * (1 - even)), (EVEN, written * even))


def call_terms(func: Any, args: tuple, kwargs: Mapping[str, Any], out: Any,
               random: bool) -> tuple[tuple[str, float], ...]:
    """One call's terms as a plan records them: the call's own key where it can be made again
    to be timed (:mod:`fxckpt.cost.timed_calls`; the table prices it by its terms), else its
    :func:`price_terms`."""
    terms = price_terms(func, args, kwargs, out, random)
    timed = timed_calls.key(func, args, dict(kwargs), out, terms) if terms else None
    return terms if timed is None else ((timed, 1.0),)


class Prices(Protocol):
    """What prices :func:`price_terms`' terms: :class:`PriceTable`, or a table measured on the
    machine (:class:`fxckpt.cost.cpu_table.MeasuredTable`)."""

    def price(self, key: str) -> float: ...

    def work(self, terms: Iterable[tuple[str, float]]) -> float: ...


@dataclasses.dataclass(frozen=True)
class PriceTable:
    """FLOP-equivalents per unit of each :func:`price_terms` key: the CPU's prices.

    :data:`TABLE` holds this module's constants, measured on the project's benchmark machine;
    :func:`fxckpt.cost.cpu_table.measured_table` measures the machine a plan runs on."""

    call: float
    per_byte: Mapping[str, float]
    """Per byte written, by op name; :attr:`default` for an op with no entry."""
    default: float
    random: float
    gelu_tanh: float
    reductions: Mapping[str, float]
    """Per byte read, by reduction name."""
    attention: float = CPU_ATTENTION_FACTOR - 1

    def price(self, key: str) -> float:
        """FLOP-equivalents per unit of ``key``."""
        if key == "call":
            return self.call
        if key in ("random", EVEN):
            return self.random
        if key == "gelu_tanh":
            return self.gelu_tanh
        if key == "attention":
            return self.attention
        if key == "other":
            return OTHER_DEVICE_PRICE
        if key == "other_random":
            return OTHER_DEVICE_RANDOM_PRICE
        if key.startswith("read:"):
            return self.reductions[key[5:]]
        if key.startswith(timed_calls.PREFIX):  # a call made again to be timed: its terms here
            return self.work(timed_calls.terms_of(key)) if timed_calls.known(key) else 0.0
        return self.per_byte.get(key, self.default)

    def work(self, terms: Iterable[tuple[str, float]]) -> float:
        """FLOP-equivalents of ``terms``."""
        return sum(self.price(key) * amount for key, amount in terms)


TABLE = PriceTable(call=CALL_PRICE, per_byte=CPU_PRICES, default=DEFAULT_PRICE,
                   random=RANDOM_PRICE, gelu_tanh=GELU_TANH_PRICE, reductions=REDUCTIONS)
"""This module's constants: the project's benchmark machine (``device_profile="cpu"``)."""


def call_price(func: Any, args: tuple, kwargs: Mapping[str, Any], out: Any,
               random: bool) -> float:
    """FLOP-equivalents of one call beyond its FLOPs at :data:`TABLE`'s prices: the call price,
    plus, for a call without a FLOP formula, its bytes written (read, for reductions) at its
    price. Views write nothing; an in-place call writes its output's bytes."""
    return TABLE.work(price_terms(func, args, kwargs, out, random))
