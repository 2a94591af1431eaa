"""The CPU's prices, measured on the machine a plan runs on.

:data:`fxckpt.cost.prices.TABLE` was measured once, on the project's benchmark machine. Another
CPU prices the same calls differently, and not by one factor: on an Intel Xeon whose matmul runs
at 180-200 GFLOP/s (the AMD EPYC the table was measured on: 90-100), ``mul`` and ``add`` cost
2.8x the table's FLOP-equivalents per byte, ``sigmoid`` 2.5x, a Bernoulli draw at one half 3.1x,
``exp`` 0.4x and ``tanh`` 0.26x (``python -m benchmarks.calibrate``, ``docs/tuning.md``; part of
that was page faults, which timing now leaves out: :func:`~fxckpt.cost.timed_calls.fastest_pass`).
A draw is measured twice, at ``p`` = 1 and at one half, and a draw of probability ``p`` priced
between the two (:data:`fxckpt.cost.prices.EVEN`): priced at one half, a dropout of 0.1 (a draw
at 0.9) was priced at 2.1x its time in the GPT-2 bench step. A plan
priced with the wrong table recomputes what is expensive here and keeps what is cheap. So, as a
GPU's rates are (:mod:`fxckpt.cost.devices`), the CPU's are measured where the model runs, once
per process:

* the **unit**: a 1024 x 1024 fp32 matmul's FLOP/s;
* **each call** a graph makes, timed at its own shapes, strides and arguments
  (:mod:`fxckpt.cost.timed_calls`), the first time a graph holds it: its price is its time in
  FLOP-equivalents, less its FLOPs (which the node counts);
* for a call that cannot be made again, the **call price** (a call on a one-element tensor) and
  its op's **price per byte written** (read, for a reduction), on 1 MiB float32 tensors read
  from memory (:data:`COLD`); an op with no call here (:func:`_calls`) at the table's price
  times the median ratio, measured over table, of the ops measured so far;
* the **overheads** of a segment, a kept node and a saved tensor are the table's, in seconds
  (:func:`fxckpt.cost.devices.cpu_profile`).

Each price is rounded to a quarter power of two: timings vary by 10-20% from run to run, and a
rounded price rarely moves, so a model mostly gets the same plan in every process on a machine.
Timing takes a few ms per distinct call (a model of repeated blocks has few).
``device_profile="cpu"`` plans with the table instead, and the environment variable
``FXCKPT_CPU_PRICES=table`` makes that the default (the test suite sets it, so its plans are
the same on every machine). A job of several processes is priced with the table too: its ranks
must make the same plans (:func:`uses_measured_prices`).

Timed alone, calls take 0.72-0.91 of their time inside a training step (the bench models,
``docs/step_time.md``): the autograd engine, the Python around each call and a busier cache are
not in them. Plans rank by these prices; the step a plan predicts is that much short.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from typing import Callable, Iterable, Mapping, Optional

import torch
import torch.nn.functional as F

from fxckpt.cost import timed_calls
from fxckpt.cost.prices import EVEN, TABLE
from fxckpt.cost.rates import fastest

__all__ = ["MeasuredTable", "measured_table", "matmul_rate", "cold_seconds", "call_seconds",
           "TIME_LIMIT",
           "uses_measured_prices", "several_processes", "OPS",
           "COLD", "TABLE_RATE", "ENV"]

ENV = "FXCKPT_CPU_PRICES"
"""``measured`` (the default) or ``table``: what a plan for a CPU model is priced with when no
``device_profile`` is named."""

TABLE_RATE = 96e9
"""The matmul rate (FLOP/s) :data:`~fxckpt.cost.prices.TABLE` was measured at: its unit."""

COLD = 16
"""1 MiB inputs an op's price is measured over, in turn: more than a core's own caches hold, as
a model's activations are (a price measured on one cached input was 2-4x too low against
measured steps)."""

MiB = 1 << 20

TIME_LIMIT = 10.0
"""Seconds a process spends timing calls, at most (a model of many distinct shapes): past it,
calls not timed yet are priced per byte, their ops measured on 1 MiB."""

Call = Callable[[torch.Tensor], object]

_GENERATOR = torch.Generator().manual_seed(0)
"""What measuring draws from: never torch's default generator, whose draws a model's dropout
masks must follow as they would without fxckpt."""


def _calls() -> dict[str, Call]:
    """Price key (:func:`~fxckpt.cost.prices.price_terms`) -> a call on a positive 256 x 1024
    float32 tensor that runs that op."""
    return {
        "mul": lambda x: x * 1.5, "add": lambda x: x + 1.5, "sub": lambda x: x - 1.5,
        "div": lambda x: x / 1.5, "relu": torch.relu, "clone": torch.clone,
        "sigmoid": torch.sigmoid, "silu": F.silu, "rsqrt": torch.rsqrt, "sqrt": torch.sqrt,
        "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "_softmax": lambda x: torch.softmax(x, -1),
        "_log_softmax": lambda x: torch.log_softmax(x, -1),
        "native_layer_norm": lambda x: F.layer_norm(x, x.shape[-1:]),
        "exp": torch.exp, "log": torch.log, "tanh": torch.tanh, "sin": torch.sin,
        "cos": torch.cos, "erf": torch.erf, "pow": lambda x: x.pow(2),
        "gt": lambda x: x > 1.0,
        "random": lambda x: x.bernoulli_(1.0, generator=_GENERATOR),
        EVEN: lambda x: x.bernoulli_(0.5, generator=_GENERATOR),
        "read:sum": lambda x: x.sum(-1), "read:mean": lambda x: x.mean(-1),
        "read:amax": lambda x: x.amax(-1),
    }


OPS = tuple(_calls())
"""The price keys measured by running their op; the others are scaled (module docstring)."""


def cold_seconds(fn: Call, repeats: int = 3, cold: int = COLD) -> float:
    """Seconds of one call of ``fn`` on a 1 MiB input read from memory: the fastest of
    ``repeats`` passes over ``cold`` inputs in turn, after one warm-up pass (the fastest, not
    the median: what else runs on the machine only ever adds time), each output alive through
    the next pass (:func:`fxckpt.cost.timed_calls.fastest_pass`)."""
    xs = [torch.rand(256, 1024, generator=_GENERATOR) + 0.5 for _ in range(cold)]
    return timed_calls.fastest_pass([functools.partial(fn, x) for x in xs], repeats)


def matmul_rate(repeats: int = 5) -> float:
    """FLOP/s of a 1024 x 1024 fp32 matmul here: the unit a measured table is taken in."""
    a = torch.full((1024, 1024), 0.5)
    return 2 * 1024 ** 3 / fastest(lambda: a @ a, repeats=repeats)


def call_seconds(calls: int = 200, repeats: int = 5) -> float:
    """Seconds of a call on a one-element tensor (the fastest of ``repeats`` loops)."""
    one = torch.ones(1)
    return fastest(lambda: [one + one for _ in range(calls)], repeats=repeats) / calls


def _rounded(price: float) -> float:
    """``price`` at the nearest quarter power of two (0 stays 0)."""
    return 0.0 if price <= 0 else 2.0 ** (round(4 * math.log2(price)) / 4)


class MeasuredTable:
    """Prices (:class:`~fxckpt.cost.prices.PriceTable`'s interface) measured here, each the
    first time it is asked for (module docstring)."""

    def __init__(self, rate: float, call: float) -> None:
        self.rate, self.call = rate, call
        """The matmul rate (FLOP/s, the unit) and a call's price."""
        self.measured: dict[str, float] = {}
        self.spent = 0.0
        """Seconds spent timing calls (:data:`TIME_LIMIT`)."""
        self._calls = _calls()

    def price(self, key: str) -> float:
        """FLOP-equivalents per unit of ``key`` on this machine."""
        if key == "call":
            return self.call
        if key in ("attention", "other", "other_random"):
            return TABLE.price(key)
        if key.startswith(timed_calls.PREFIX):
            return self._timed(key)
        if key not in self.measured:
            fn = self._calls.get(key)
            if fn is None:
                return _rounded(TABLE.price(key) * self.scale)
            with torch.no_grad():
                seconds = cold_seconds(fn)
            self.measured[key] = _rounded(max(0.0, seconds * self.rate - self.call) / MiB)
        return self.measured[key]

    def _timed(self, key: str) -> float:
        """A call timed at its own shapes and layout, less its FLOPs (which the node's FLOPs
        count): at its terms' prices here when it cannot be made again."""
        if key not in self.measured:
            if not timed_calls.known(key):
                return 0.0
            if self.spent > TIME_LIMIT:  # enough planning time spent timing: per byte now
                return self.work(timed_calls.terms_of(key))
            start = time.perf_counter()
            try:
                seconds = timed_calls.timed(key)
            except Exception:  # noqa: BLE001 - made again wrongly (an index out of range...)
                self.measured[key] = self.work(timed_calls.terms_of(key))
            else:
                self.measured[key] = _rounded(seconds * self.rate) - timed_calls.flops_of(key)
            self.spent += time.perf_counter() - start
        return self.measured[key]

    def work(self, terms: Iterable[tuple[str, float]]) -> float:
        """FLOP-equivalents of ``terms``."""
        return sum(self.price(key) * amount for key, amount in terms)

    @property
    def scale(self) -> float:
        """The median ratio of measured prices to the table's (1 before any is measured)."""
        ratios = [p / TABLE.price(k) for k, p in self.measured.items()
                  if not k.startswith(timed_calls.PREFIX) and TABLE.price(k) > 0]
        return statistics.median(ratios) if ratios else 1.0


@functools.cache
def measured_table() -> MeasuredTable:
    """This machine's table (its ops measured as plans need them), once per process."""
    rate = matmul_rate()
    call = call_seconds() * rate
    return MeasuredTable(rate, _rounded(call))


def uses_measured_prices(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether a CPU plan with no named profile is priced with :func:`measured_table` (the
    default) rather than the table: not under ``FXCKPT_CPU_PRICES=table``, and not in a job of
    several processes (``WORLD_SIZE`` over 1, or an initialised process group of more than one
    rank). There every rank must make the same plan: a rank that recomputes a segment another
    does not would all-gather alone under FSDP, and pipeline stages are cut around segments."""
    environ = os.environ if environ is None else environ
    value = environ.get(ENV, "measured")
    if value not in ("measured", "table"):
        from fxckpt.errors import ConfigError

        raise ConfigError(f"{ENV} must be 'measured' or 'table' (got {value!r})")
    return value == "measured" and not several_processes(environ)


def several_processes(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process is one of a job of several (``WORLD_SIZE`` over 1, or an
    initialised process group of more than one rank)."""
    environ = os.environ if environ is None else environ
    try:
        if int(environ.get("WORLD_SIZE", "1")) > 1:
            return True
    except ValueError:
        pass
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
