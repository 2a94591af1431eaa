"""The strategies :func:`fxckpt.transform` accepts, as one union of small frozen types.

    transform(model, every=2)        -> Every(units=2)
    transform(model, depth=3)        -> Depth(depth=3)
    transform(model, budget="6GiB")  -> Budgeted(budget=Budget(bytes=6 * 2**30))
    transform(model, plan=saved)     -> Replay(plan=saved)

Each has a pass in :mod:`fxckpt.planning.strategies` that returns its segments and notes; ``force``
pins apply on top of any of them (or alone), and the rules every segment obeys
(:mod:`fxckpt.planning.cleanup`) apply to all.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional, Union

from fxckpt.budget import Budget
from fxckpt.checks import check_int
from fxckpt.errors import ConfigError
from fxckpt.plan import Plan

__all__ = ["Every", "Depth", "Budgeted", "Replay", "Strategy", "strategy_from"]


@dataclasses.dataclass(frozen=True)
class Every:
    """Segments of ``units`` units of work each (nodes with FLOPs: matmuls, convolutions,
    attention)."""

    units: int
    name: ClassVar[str] = "every"

    def __post_init__(self) -> None:
        check_int("every", self.units)

    def reason(self) -> str:
        return f"every={self.units}"


@dataclasses.dataclass(frozen=True)
class Depth:
    """One segment per module at nesting ``depth`` (``layers.3`` has depth 2)."""

    depth: int
    name: ClassVar[str] = "depth"

    def __post_init__(self) -> None:
        check_int("depth", self.depth)

    def reason(self) -> str:
        return f"depth={self.depth}"


@dataclasses.dataclass(frozen=True)
class Budgeted:
    """The least recompute whose predicted peak activation memory fits ``budget``."""

    budget: Budget
    name: ClassVar[str] = "budget"

    def reason(self) -> str:
        return "budget: least recompute under the peak"


@dataclasses.dataclass(frozen=True)
class Replay:
    """A saved plan's segments, used as they are (no solving)."""

    plan: Plan
    name: ClassVar[str] = "replay"

    def reason(self) -> str:
        return "replayed from a saved plan"


Strategy = Union[Every, Depth, Budgeted, Replay]


def strategy_from(*, every: Any = None, depth: Any = None, budget: Optional[Budget] = None,
                  plan: Optional[Plan] = None) -> Optional[Strategy]:
    """The one strategy ``transform``'s keywords name (``None`` for none); two or more are refused.
    """
    given = {
        k: v
        for k, v in (("every", every), ("depth", depth), ("budget", budget), ("plan", plan))
        if v is not None
    }
    if len(given) > 1:
        shown = " and ".join(f"{k}={_show(v)}" for k, v in given.items())
        raise ConfigError(f"give at most one strategy, got {shown}; choose one of them")
    if every is not None:
        return Every(every)
    if depth is not None:
        return Depth(depth)
    if budget is not None:
        return Budgeted(budget)
    return None if plan is None else Replay(plan)


def _show(value: object) -> str:
    if isinstance(value, Budget):
        return str(value)
    return "<Plan>" if isinstance(value, Plan) else repr(value)
