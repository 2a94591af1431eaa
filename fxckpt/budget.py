"""What a memory budget means, and how users may write one.

A budget bounds the **peak activation memory of one training step**: the highest memory during
forward and backward above what was held just before the step (parameters, gradients and
optimizer state are not counted). It can be written as

* a fraction in (0, 1]: of the unmodified model's peak activation memory for the same inputs;
* an ``int`` number of bytes;
* a string with a unit: ``"800MB"``, ``"1.5GiB"``, ``"512 KiB"`` (SI units are powers of 1000,
  IEC units powers of 1024).

A string without a unit (from a config file or the command line) means what the same number
means written in Python: ``"0.5"`` and ``"1.0"`` are fractions, ``"4096"`` and ``"2_000_000"``
are bytes, ``"1.5"`` is refused. So ``budget="0.5"``, ``budget=0.5`` and ``--budget 0.5`` agree.

``1`` (an int, or the string ``"1"``) is refused as ambiguous: as bytes it is a budget no model
fits in, and people who write it mean the whole eager peak (``1.0``) or a size (``"1GiB"``).
Every value is checked when :func:`parse_budget` runs, which :func:`fxckpt.transform` does
before it returns.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Union

from fxckpt.errors import ConfigError
from fxckpt.errors import BudgetInfeasibleError  # re-exported: its home before errors.py

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
    if isinstance(value, (int, float)):
        return _number(value, value)
    if isinstance(value, str):
        number = _unitless(value)
        if number is not None:
            return _number(number, value)
        return Budget(bytes=_parse_size(value))
    raise ConfigError(_help(value, f"a {type(value).__name__} is not a budget"))


def _number(number: Union[int, float], shown: Union[int, float, str]) -> Budget:
    """``number`` as a budget; errors show the value as the user wrote it (``shown``)."""
    if isinstance(number, int):
        if number <= 0:
            raise ConfigError(_help(shown, "a byte count must be positive"))
        if number == 1:
            raise ConfigError(_ambiguous(shown))
        return Budget(bytes=number)
    if math.isnan(number) or not 0.0 < number <= 1.0:
        raise ConfigError(
            _help(shown, "a float budget is a fraction of the eager peak, in (0, 1]")
        )
    return Budget(fraction=number)


def _unitless(text: str) -> Union[int, float, None]:
    """The Python number a unitless string spells: ``"0.5"`` -> 0.5, ``"4_096"`` -> 4096."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return None


def _parse_size(text: str) -> int:
    match = _PATTERN.match(text)
    if match is None or match.group(2).lower() not in UNITS:
        raise ConfigError(_help(text, "cannot read it as a number with a unit"))
    number = float(match.group(1))
    if not number > 0:
        raise ConfigError(_help(text, "a size must be positive"))
    if not math.isfinite(number * UNITS[match.group(2).lower()]):
        raise ConfigError(_help(text, "it is larger than any memory"))
    size = int(number * UNITS[match.group(2).lower()])
    if size < 1:
        raise ConfigError(_help(text, "it is less than one byte"))
    return size


def _ambiguous(value: object) -> str:
    return (
        f"budget={value!r} is ambiguous: as a number of bytes it is one byte, which no model "
        "fits in. Write 1.0 for the whole peak activation memory of the unmodified model (a "
        "fraction), or a size with a unit such as '1GiB'"
    )


def _help(value: object, why: str) -> str:
    return (
        f"budget={value!r} is not valid: {why}. Give a fraction in (0, 1] of the unmodified "
        "model's peak activation memory (0.4), a number of bytes (2_000_000_000), or a size "
        "with a unit ('800MB', '1.5GiB')"
    )
