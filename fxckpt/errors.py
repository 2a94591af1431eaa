"""Errors fxckpt raises.

Every error says what was wrong, the value that was seen and how to fix it. They all derive from
:class:`FxckptError` so callers can catch fxckpt's own failures in one place; the ones about bad
arguments also derive from ``ValueError`` / ``TypeError`` so ordinary argument checking code
keeps working.
"""

from __future__ import annotations

__all__ = [
    "FxckptError",
    "ConfigError",
    "ConfigTypeError",
    "CaptureError",
    "PlanError",
    "NotPlannedError",
    "InputError",
    "VerifyError",
    "MeasureError",
    "ExportError",
]


class FxckptError(Exception):
    """Base class of every error fxckpt raises on purpose."""


class ConfigError(FxckptError, ValueError):
    """An argument to :func:`fxckpt.transform` is out of range or conflicts with another."""


class ConfigTypeError(ConfigError, TypeError):
    """An argument is not even of the right type (``transform("not a module")``).

    A :class:`ConfigError` like every bad argument, and a ``TypeError`` as Python code expects.
    """


class CaptureError(FxckptError, RuntimeError):
    """The model could not be turned into a ``torch.fx`` graph by any capture method."""


class PlanError(FxckptError, RuntimeError):
    """A pass could not build or apply a plan for this graph."""


class NotPlannedError(FxckptError, RuntimeError):
    """The transformed module has not planned yet (no call and no ``example_inputs``)."""


class InputError(FxckptError, TypeError):
    """A call's arguments cannot be planned for safely (e.g. a mutable object fxckpt cannot key).
    """


class VerifyError(FxckptError, RuntimeError):
    """A training step could not be executed on fake tensors (the plan is then only simulated)."""


class MeasureError(FxckptError, RuntimeError):
    """A measurement could not be taken (no ``/proc``, or the measuring subprocess failed)."""


class ExportError(FxckptError, RuntimeError):
    """A module cannot be saved, or a directory is not a valid, intact fxckpt export."""
