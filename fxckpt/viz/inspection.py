"""What fxckpt decided for a transformed module, read through one function: :func:`inspect`.

The transformed module is the model (see :mod:`fxckpt.module`), so fxckpt's own views cannot be
attributes of it — a model may have a child called ``model`` or ``plan``, and every Hugging Face
model has a ``config``. They live here instead::

    info = fxckpt.inspect(tm)
    print(info.plan)        # segments, what each keeps and frees, predicted peak, stages
    print(info.code)        # the rewritten forward: `x = fxckpt_checkpoint(segment_0, x)`
    info.plan_for(x)        # plan now for these inputs (no step), returns the plan
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Optional, Union, overload

import torch
import torch.fx

from fxckpt.config import TransformConfig
from fxckpt.errors import ConfigError, NotPlannedError, not_planned, not_transformed
from fxckpt.plan import Plan

if TYPE_CHECKING:
    from fxckpt.export.loaded import LoadedModule
    from fxckpt.serve.refine import Refinement

__all__ = ["Inspection", "LoadedInspection", "inspect"]

_VIEWS: "weakref.WeakKeyDictionary[Any, dict[int, Any]]" = weakref.WeakKeyDictionary()
"""Graph views (networkx) per dispatcher and plan: flattening costs a pass over the graph."""


class Inspection:
    """fxckpt's view of one transformed module: its options, plans, graphs and stages."""

    def __init__(self, tm: torch.nn.Module) -> None:
        from fxckpt.module import dispatcher_of

        self.module = tm
        self._dispatcher = dispatcher_of(tm)

    @property
    def model(self) -> torch.nn.Module:
        """The model ``fxckpt.transform`` was given (it shares every parameter and buffer)."""
        return self._dispatcher.model

    @property
    def config(self) -> TransformConfig:
        """The options ``fxckpt.transform`` was given, checked."""
        return self._dispatcher.config

    def plan_for(self, *args: Any, **kwargs: Any) -> Plan:
        """Plan (if needed) for these inputs in the module's current mode, without running a step.

        Unlike a call, this plans in ``eval()`` mode too (an export saves eval graphs this way).
        """
        return self._dispatcher.compiled_for(self.module, args, kwargs).plan

    @property
    def plan(self) -> Plan:
        """The plan used by the latest training call (or made by ``plan_for`` /
        ``example_inputs``); through Dynamo, the largest graph's."""
        return self._current().plan

    @property
    def plans(self) -> list[Plan]:
        """Every plan made so far, oldest first."""
        return [c.plan for c in self._dispatcher.compiled()]

    @property
    def graphs(self) -> list[Any]:
        """With ``capture="dynamo"``: the graphs the latest training call ran, in order, each a
        :class:`~fxckpt.serve.dynamo.GraphRecord` (its plan, what it holds for backward, and why
        Dynamo ended it); empty otherwise."""
        driver = self._dispatcher.dynamo
        return [] if driver is None else list(driver.step or driver.records)

    @property
    def unplanned_share(self) -> Optional[float]:
        """With ``capture="dynamo"``: the share of the training forward's FLOPs that ran outside
        the graphs fxckpt planned (Python between graph breaks, frames Dynamo skips), measured
        at the first call and at the call after each compile; ``None`` before (or otherwise)."""
        driver = self._dispatcher.dynamo
        return None if driver is None else driver.unplanned_share

    @property
    def refinement(self) -> Optional["Refinement"]:
        """What the first training steps measured of the checkpointed segments' times, and
        whether the plans were made again with the prices it refined
        (:mod:`fxckpt.serve.refine`); ``None`` before then, or where prices are not refined
        (a named ``device_profile``, the CPU table, no budget)."""
        return self._dispatcher.refiner.result

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """The rewritten GraphModule of the latest plan."""
        return self._current().gm

    @property
    def code(self) -> str:
        """Python code of the rewritten graph (segments appear as ``fxckpt_checkpoint(...)``
        calls)."""
        return self.graph_module.code

    @property
    def pipeline(self) -> Optional[torch.nn.Module]:
        """The pipelined runner of the latest plan (``None`` without stages): ``.recomputed``,
        ``.stage_modules``, ``.describe()``."""
        return self._current().pipeline

    @property
    def view(self) -> Any:
        """The latest plan's graph as a ``networkx.DiGraph`` (what ``fxckpt.show`` draws)."""
        from fxckpt.passes.flatten import labelled_graph

        compiled = self._current()
        views = _VIEWS.setdefault(self._dispatcher, {})
        if id(compiled) not in views:
            views[id(compiled)] = labelled_graph(compiled.gm, compiled.plan)
        return views[id(compiled)]

    @property
    def offload_stats(self) -> Any:
        """What the latest training step offloaded (``None`` without ``offload=``)."""
        offloader = self._dispatcher.offloader
        return None if offloader is None else offloader.stats

    @property
    def captures(self) -> int:
        """How many graphs were captured so far (one per mode and call structure, not per
        shape)."""
        return self._dispatcher.counts.captures

    @property
    def plans_made(self) -> int:
        """How many plans were made so far."""
        return self._dispatcher.counts.plans

    @property
    def planning_seconds(self) -> float:
        """Time spent capturing and planning so far (seconds)."""
        counts = self._dispatcher.counts
        return counts.capture_seconds + counts.plan_seconds

    def _current(self) -> Any:
        compiled = self._dispatcher.last
        if compiled is None:
            raise NotPlannedError(not_planned(
                "there is no plan to inspect",
                "call it once in training, pass example_inputs= to fxckpt.transform, or use "
                "fxckpt.inspect(tm).plan_for(*inputs)"))
        return compiled

    def __repr__(self) -> str:
        last = self._dispatcher.last
        what = "not planned yet" if last is None else last.plan.summary()
        return f"<fxckpt.inspect of {type(self.module).__name__}: {what}>"


class LoadedInspection:
    """The same view of a module :func:`fxckpt.load` returned (its latest call's saved graph)."""

    def __init__(self, loaded: Any) -> None:
        self.module = loaded

    @property
    def plan(self) -> Plan:
        return self.module.plan

    @property
    def plans(self) -> list[Plan]:
        return [v.plan for v in self.module.variants]

    @property
    def code(self) -> str:
        return self.module.code

    @property
    def graph_module(self) -> torch.nn.Module:
        return self.module.graph_module

    @property
    def pipeline(self) -> Optional[torch.nn.Module]:
        return self.module.pipeline

    @property
    def view(self) -> Any:
        return self.module.variant.view


@overload
def inspect(tm: LoadedModule) -> LoadedInspection: ...  # type: ignore[overload-overlap]


@overload
def inspect(tm: torch.nn.Module) -> Inspection: ...


def inspect(tm: torch.nn.Module) -> Union[Inspection, LoadedInspection]:
    """fxckpt's plans, code and stages for a module :func:`fxckpt.transform` (or ``load``)
    returned."""
    from fxckpt.export.loaded import LoadedModule
    from fxckpt.module import is_transformed

    if isinstance(tm, LoadedModule):
        return LoadedInspection(tm)
    if not is_transformed(tm):
        raise ConfigError(not_transformed("fxckpt.inspect", tm))
    return Inspection(tm)
