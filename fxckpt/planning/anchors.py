"""Anchors: names for a graph's nodes that survive capturing the model again elsewhere.

A plan names its segments' nodes as the captured graph called them (``mul_17``). Those names are
counters, so the same model captured on another device can number them differently: a model
planned on the ``meta`` device and trained on the CPU is captured twice, and where a kernel's
output strides differ between the two devices ``torch.export`` records a ``contiguous`` on one
and not the other, which shifts every later ``mul_<n>``. The structure is the same.

An anchor is what a node is, not what it was called: the module it came from, its op, and how
many nodes of that module with that op came before it (``model.layers.3.mlp|aten.mul.Tensor|1``).
A plan stores the anchors of each segment's first and last node and of each node it keeps
(:attr:`fxckpt.plan.SegmentSpec.anchors`), and :func:`remap` finds them in another capture.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.fx
from torch.fx.node import _get_qualified_name

from fxckpt.errors import PlanError
from fxckpt.cost.annotate import module_path_of

__all__ = ["anchors_of", "remap", "target_name"]


def not_in_graph(segment: str, names: str, *, nor: str = "", signature: str = "") -> PlanError:
    """A saved plan's ``segment`` ``names`` a place this model's graph does not have (``nor``:
    what else was looked for): the refusal of every way of replaying a saved plan."""
    made = f" ({signature})" if signature else ""
    return PlanError(f"the saved plan's {segment} {names}, which this model's graph does not "
                     f"have{nor}: the plan was made for another model, mode or input "
                     f"signature{made}")


def anchors_of(order: Sequence[torch.fx.Node]) -> dict[str, str]:
    """Node name -> anchor, for the planned nodes ``order`` (in graph order)."""
    seen: dict[tuple[str, str], int] = {}
    out = {}
    for n in order:
        what = (module_path_of(n), target_name(n.target))
        k = seen.get(what, 0)
        seen[what] = k + 1
        out[n.name] = f"{what[0]}|{what[1]}|{k}"
    return out


def target_name(target: object) -> str:
    """A node's target as text that is the same in every process: ``aten.mul.Tensor``,
    ``torch.arange``, a module path (never ``<built-in method arange ... at 0x7f...>``)."""
    if isinstance(target, (str, torch._ops.OpOverload)):
        return str(target)
    try:
        return _get_qualified_name(target)  # type: ignore[arg-type]
    except Exception:  # a callable torch.fx cannot name: its type and name, without an address
        return f"{type(target).__qualname__}.{getattr(target, '__name__', '?')}"


def remap(order: Sequence[torch.fx.Node], segments: Sequence[tuple[str, tuple[str, ...]]]
          ) -> tuple[list[list[torch.fx.Node]], list[str]]:
    """Each segment's run on this graph, from its anchors, and the nodes it keeps.

    ``segments``: (segment name, anchors) pairs, anchors as :attr:`SegmentSpec.anchors` holds them
    (first node, last node, then each kept node). A run is every node from the first anchor's
    node to the last's; nodes this capture has and the other did not (a ``contiguous``) join the
    run they fall in. A kept node this graph lacks is recomputed instead, which only lowers the
    peak.
    """
    position = {a: i for i, a in enumerate(anchors_of(order).values())}
    runs, keeps = [], []
    for name, anchors in segments:
        if len(anchors) < 2:
            raise PlanError(f"the saved plan's {name} has no anchors to find its nodes by")
        ends = [position.get(a) for a in anchors[:2]]
        if ends[0] is None or ends[1] is None or ends[1] < ends[0]:
            missing = anchors[0] if ends[0] is None else anchors[1]
            raise not_in_graph(name, f"starts or ends at {missing!r} (module|op|occurrence)")
        lo, hi = ends[0], ends[1]
        runs.append(list(order[lo:hi + 1]))
        keeps += [order[position[a]].name for a in anchors[2:]
                  if a in position and lo <= position[a] <= hi]
    return runs, keeps
