"""What a memory budget means, and how users may write one.

A budget bounds the **peak activation memory of one training step**: the highest memory during
forward and backward above what was held just before the step (parameters, gradients and
optimizer state are not counted). It can be written as

* a fraction in (0, 1]: of the unmodified model's peak activation memory for the same inputs;
* an ``int`` number of bytes;
* a string with a unit: ``"800MB"``, ``"1.5GiB"``, ``"512 KiB"`` (SI units are powers of 1000,
  IEC units powers of 1024; a bare number is bytes).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Union

from fxckpt.errors import ConfigError, FxckptError
from fxckpt.solver.problem import BudgetInfeasible

__all__ = ["Budget", "BudgetInfeasibleError", "parse_budget", "UNITS"]

UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}

_PATTERN = re.compile(
    r"^\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE
)


class BudgetInfeasibleError(FxckptError, BudgetInfeasible):
    """No plan keeps the peak activation memory under the budget.

    ``budget`` is the budget in bytes and ``min_budget`` the smallest peak (in bytes) any plan
    reaches for this model and input. The solver's :class:`~fxckpt.solver.BudgetInfeasible`
    with fxckpt's error base: ``BudgetInfeasibleError(budget, min_budget, message)``. Either
    class catches both.
    """


@dataclasses.dataclass(frozen=True)
class Budget:
    """A parsed budget: either an absolute byte count or a fraction of the eager peak."""

    bytes: int | None = None
    fraction: float | None = None

    def resolve(self, eager_peak: int) -> int:
        """Bytes, given the unmodified model's predicted peak activation memory."""
        if self.bytes is not None:
            return self.bytes
        return int(self.fraction * eager_peak)  # type: ignore[operator]

    def __str__(self) -> str:
        return (
            f"{self.fraction:g} of the eager peak"
            if self.fraction is not None
            else f"{self.bytes} bytes"
        )


def parse_budget(value: Union[int, float, str]) -> Budget:
    """Parse a user's ``budget=`` value; raise :class:`ConfigError` saying what is accepted."""
    if isinstance(value, bool):
        raise ConfigError(_help(value, "a bool is not a budget"))
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(_help(value, "a byte count must be positive"))
        return Budget(bytes=value)
    if isinstance(value, float):
        if math.isnan(value) or not 0.0 < value <= 1.0:
            raise ConfigError(
                _help(value, "a float budget is a fraction of the eager peak, in (0, 1]")
            )
        return Budget(fraction=value)
    if isinstance(value, str):
        return Budget(bytes=_parse_size(value))
    raise ConfigError(_help(value, f"a {type(value).__name__} is not a budget"))


def _parse_size(text: str) -> int:
    match = _PATTERN.match(text)
    if match is None or match.group(2).lower() not in UNITS:
        raise ConfigError(_help(text, "cannot read it as a number with a unit"))
    number = float(match.group(1))
    if not number > 0:
        raise ConfigError(_help(text, "a size must be positive"))
    return int(number * UNITS[match.group(2).lower()])


def _help(value: object, why: str) -> str:
    return (
        f"budget={value!r} is not valid: {why}. Give a fraction in (0, 1] of the unmodified "
        "model's peak activation memory (0.4), a number of bytes (2_000_000_000), or a size "
        "with a unit ('800MB', '1.5GiB')"
    )
