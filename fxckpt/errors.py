"""Errors fxckpt raises: every error class of the package is defined here (only a private
signal that one module raises and catches itself stays in that module).

Every error says what was wrong, the value that was seen and how to fix it. The public ones all
derive from :class:`FxckptError` so callers can catch fxckpt's own failures in one place; the
ones about bad arguments also derive from ``ValueError`` / ``TypeError`` so ordinary argument
checking code keeps working.

``__all__`` lists the errors of the public API (each is on the top level, ``fxckpt.CaptureError``).
The rest belong to one part of fxckpt, which imports them from here and is where users name them:
the solver's :class:`BudgetInfeasible` (``fxckpt.solver``, pure data: no ``FxckptError``) and its
:class:`Exhausted` signal, the export codec's :class:`Unencodable`, the command line's
:class:`CliError` and :class:`SourceError`, Dynamo planning's :class:`AfterBreakInfeasible`,
the compiled-step probe's :class:`Partitioned` signal. This module imports nothing of fxckpt,
so every part can import it.
"""

from __future__ import annotations

from typing import Optional, Protocol

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
    "BudgetInfeasibleError",
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


def grad_mode_left(forward: str, on: bool) -> str:
    """Why ``forward`` (``"the forward"``, ``"GPT.forward"``) cannot be captured when it turns
    gradients ``on`` (or off) and returns so; every capture method refuses it with this message.
    """
    return (f"{forward} turns gradients {'on' if on else 'off'} (torch.set_grad_enabled) and "
            "leaves them so when it returns; a graph cannot leave the caller's grad mode "
            "changed. Use `with torch.no_grad():` around the part that needs it")


class PlanError(FxckptError, RuntimeError):
    """A pass could not build or apply a plan for this graph."""


class NotPlannedError(FxckptError, RuntimeError):
    """The transformed module has not planned yet (no call and no ``example_inputs``)."""


def not_planned(needs: str, remedy: str) -> str:
    """The message for a module that has not planned yet: ``needs``, what is missing for the
    request (``"there is no graph to save"``); ``remedy``, how to plan it."""
    return (f"this module has not planned yet, so {needs}: it plans at its first training call "
            f"(eval() and no_grad() calls run the model itself); {remedy}")


def dynamo_needs_whole_graph(need: str) -> str:
    """The refusal of ``capture='dynamo'`` for what needs one whole graph of the model
    (``need``: ``"selective= needs one whole graph of the model"``)."""
    return (f"capture='dynamo' plans each graph Dynamo breaks the forward into, and {need}: "
            "use capture='auto' (the default: it trains through Dynamo and captures one whole "
            "graph where one is needed) or capture='graph'")


def not_transformed(who: str, got: object) -> str:
    """``who`` (``"fxckpt.save"``) was given ``got``, which fxckpt.transform did not return."""
    return (f"{who} takes a module fxckpt.transform returned (got {type(got).__name__}); "
            "transform the model first: tm = fxckpt.transform(model, ...)")


class InputError(FxckptError, TypeError):
    """A call's arguments cannot be planned for safely (e.g. a mutable object fxckpt cannot key).
    """


class VerifyError(FxckptError, RuntimeError):
    """A training step could not be executed on fake tensors (the plan is then only simulated)."""


class MeasureError(FxckptError, RuntimeError):
    """A measurement could not be taken (no ``/proc``, or the measuring subprocess failed)."""


class ExportError(FxckptError, RuntimeError):
    """A module cannot be saved, or a directory is not a valid, intact fxckpt export."""

    @classmethod
    def offloads(cls, what: str) -> ExportError:
        """``what`` (``"this module"``, ``"segment_0"``) offloads saved tensors, which no export
        holds."""
        return cls(f"{what} moves saved tensors with offload=, which an export does not hold: "
                   "exports hold recompute plans only (transform without offload= to save this "
                   "model)")

    @classmethod
    def hash_mismatch(cls, root: object, what: str) -> ExportError:
        """``what`` of the export at ``root`` does not match the hash its manifest records."""
        return cls(f"export {root} is corrupted or was modified: {what} does not match its "
                   "manifest (hash mismatch); save the module again")


class BudgetInfeasible(ValueError):
    """No plan's predicted peak fits the budget; ``min_budget`` is the smallest that fits.

    The one infeasible-budget exception: :class:`BudgetInfeasibleError` is this class made an
    ``FxckptError`` (the solver works on plain data and raises this one), raised with the user's
    budget terms.
    """

    def __init__(self, budget: int, min_budget: int, message: Optional[str] = None) -> None:
        super().__init__(message or (
            f"no checkpoint plan keeps the predicted peak activation memory under {budget} bytes; "
            f"the smallest budget any plan meets is {min_budget} bytes"
        ))
        self.budget = budget
        self.min_budget = min_budget


class BudgetInfeasibleError(FxckptError, BudgetInfeasible):
    """No plan keeps the peak activation memory under the budget.

    ``budget`` is the budget in bytes and ``min_budget`` the smallest peak (in bytes) any plan
    reaches for this model and input. The solver's :class:`BudgetInfeasible` with fxckpt's error
    base: ``BudgetInfeasibleError(budget, min_budget, message)``. Either class catches both.
    """


class AfterBreakInfeasible(BudgetInfeasibleError):
    """A graph after a break cannot fit beside what earlier graphs of the step keep.
    ``graph_peak``: its own smallest step peak, which the earlier graphs may leave room for."""

    def __init__(self, budget: int, min_budget: int, message: str, graph_peak: int) -> None:
        super().__init__(budget, min_budget, message)
        self.graph_peak = graph_peak


class Unencodable(ExportError, TypeError):
    """A value has no JSON form (the message names where it was found)."""


class CliError(Exception):
    """A mistake on the command line; printed as one line, exit code 2."""


class SourceError(Exception):
    """The command line's target model cannot be built; the message says why (one line)."""


class _Where(Protocol):
    """Where the solver's exact pass stopped (``fxckpt.solver.bounds.GaveUp``)."""

    @property
    def work(self) -> int: ...

    @property
    def states(self) -> int: ...


class Partitioned(Exception):
    """Raised by :mod:`fxckpt.measure.compiled_step`'s recording backend once AOTAutograd's
    graph is partitioned (caught there): nothing is compiled further, nothing runs."""


class Exhausted(Exception):
    """The solver's exact pass went past its limits (caught by the solver, which falls back to
    its bounded pass); ``where`` says where it stopped."""

    def __init__(self, where: _Where) -> None:
        super().__init__(f"exact search gave up after {where.work} steps "
                         f"({where.states} states at a cut)")
        self.where = where
