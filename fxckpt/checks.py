"""Argument checks, written once: each states the rule and shows the value it saw.

    check_int("every", every, low=1) -> ConfigError("every must be a positive integer (got 0)")
    check_number("offload_bandwidth", bw, low=0, strict=True)

Used wherever user input enters fxckpt (``transform``'s options, the pipeline runtime, the
distributed stages, the pictures, the measuring helpers). The solver keeps its own plain
``ValueError`` checks: it imports nothing of fxckpt.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from fxckpt.errors import ConfigError, ConfigTypeError

__all__ = ["check_example_inputs", "check_int", "check_model", "check_number", "is_int"]


def is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(
    name: str,
    value: object,
    *,
    low: int = 1,
    high: Optional[int] = None,
    unit: str = "",
    error: type[Exception] = ConfigError,
) -> int:
    """``value`` as an int in ``[low, high]``; ``error`` (a ConfigError) naming ``name`` otherwise.
    """
    if (
        not is_int(value)
        or value < low  # type: ignore[operator]
        or (high is not None and value > high)  # type: ignore[operator]
    ):
        suffix = f" {unit}" if unit else ""
        raise error(f"{name} must be {_int_rule(low, high)}{suffix} (got {value!r})")
    return value  # type: ignore[return-value]


def check_number(name: str, value: object, *, low: float = 0.0, strict: bool = False,
                 unit: str = "") -> float:
    """A finite real ``value`` >= ``low`` (> ``low`` when ``strict``); ConfigError otherwise."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (strict and value == low):  # type: ignore[operator]
        rule = "positive" if (strict and low == 0) else f"{'>' if strict else '>='} {low:g}"
        suffix = f" {unit}" if unit else ""
        raise ConfigError(f"{name} must be a {rule} number{suffix} (got {value!r})")
    return float(value)  # type: ignore[arg-type]


def check_model(model: object) -> torch.nn.Module:
    """``model`` if it is a ``torch.nn.Module``; :class:`ConfigTypeError` otherwise."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigTypeError(
            f"model must be a torch.nn.Module (got {type(model).__name__}); wrap a function in an "
            "nn.Module whose forward calls it"
        )
    return model


def check_example_inputs(value: Optional[Sequence[Any]]) -> tuple:
    """``example_inputs=`` as a tuple (``()`` for ``None``); a list is taken as the tuple."""
    if value is not None and not isinstance(value, (tuple, list)):
        raise ConfigError(f"example_inputs must be a tuple of positional inputs (got "
                          f"{type(value).__name__}); write example_inputs=(x,)")
    return tuple(value or ())


def _int_rule(low: int, high: Optional[int]) -> str:
    if high is not None:
        return f"an integer in [{low}, {high}]"
    if low == 1:
        return "a positive integer"
    if low == 0:
        return "a non-negative integer"
    return f"an integer >= {low}"
