"""How the plans of one whole-graph capture are made and checked, and planning's lock.

:class:`EntryPlanner` is the :class:`~fxckpt.serve.plan_cache.Planner` the dispatcher hands a
capture's plan cache: it builds plans (:func:`fxckpt.serve.whole_graph.build`, for the eager
step or, under ``torch.compile``, the compiled one) and verifies a plan at other sizes.
:func:`planning` makes capture and planning run one at a time, uncompiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch

from fxckpt.budget import Budget
from fxckpt.capture.isolation import CAPTURE_LOCK
from fxckpt.serve.plan_cache import plan_budget
from fxckpt.serve.sizes import padded_args
from fxckpt.signature import Shapes
from fxckpt.strategy import Budgeted

if TYPE_CHECKING:
    from fxckpt.capture.captured import Captured
    from fxckpt.config import TransformConfig
    from fxckpt.runtime.segment import Offloading
    from fxckpt.serve.whole_graph import Compiled

__all__ = ["EntryPlanner", "planning"]


class EntryPlanner:
    """How the plans of one whole-graph capture are made and checked for one transformed
    module (:class:`~fxckpt.serve.plan_cache.Planner`)."""

    def __init__(self, shapes_of: Callable[[tuple, dict], Shapes], config: TransformConfig,
                 offloader: Optional[Offloading], tm: torch.nn.Module, captured: Captured,
                 compiled_step: bool = False) -> None:
        self.shapes_of, self.config, self.offloader = shapes_of, config, offloader
        """The dispatcher's: a call's shapes as planned, the options, the offloader."""
        self.tm = tm
        self.captured = captured
        self.compiled_step = compiled_step
        """Plans are fitted to the step as ``torch.compile`` runs it."""

    def shapes(self, args: tuple, kwargs: dict) -> Shapes:
        return self.shapes_of(args, kwargs)

    def accepts(self, shapes: Shapes) -> bool:
        return self.captured.accepts(shapes)

    def build(self, args: tuple, kwargs: dict, budget: Optional[Budget] = None,
              eager: Optional[int] = None) -> Compiled:
        from fxckpt.serve.whole_graph import build

        config = self.config
        if budget is not None:
            config = dataclasses.replace(config, strategy=Budgeted(budget))
        with planning():
            return build(self.captured, config, args, kwargs, training=self.tm.training,
                         model=self.tm, eager_peak=eager, offloader=self.offloader,
                         compiled_step=self.compiled_step)

    def peak_at(self, planned: Compiled, args: tuple, kwargs: dict) -> Optional[int]:
        from fxckpt.serve.whole_graph import peak_at

        with planning():
            return peak_at(planned, self.config, args, kwargs, self.tm)

    def padded(self, args: tuple, kwargs: dict, key: Shapes, grown: set[tuple[int, int]],
               scale: int = 1) -> Optional[tuple[tuple, dict]]:
        return padded_args(args, kwargs, key, grown, scale)

    def limit(self, planned: Compiled) -> Optional[int]:
        return plan_budget(planned)


@contextlib.contextmanager
def planning() -> Iterator[None]:
    """Capture and plan one at a time in the process, with torch.compile off.

    Modules compiled on their own (``module.compile()``) are captured and annotated eagerly:
    dynamo marks a frame it first meets under a dispatch mode (annotate's) as never compiled.
    ``set_stance`` is process-wide, so two threads planning at once would put back each other's
    stance and could leave ``force_eager`` set for good: hence the lock.
    """
    with CAPTURE_LOCK, torch.compiler.set_stance("force_eager"):
        yield
