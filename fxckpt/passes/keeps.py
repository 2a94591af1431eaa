"""Selective recompute, the graph side: which nodes a segment may keep, and how the runtime finds
their outputs again.

A segment normally runs every node again in backward. With selective recompute the planner keeps
some nodes' outputs from forward instead (:mod:`fxckpt.solver.selective` chooses which); the
runtime (:mod:`fxckpt.runtime.selective`) works as torch's selective checkpoint does: it sees
aten calls, not fx nodes. So each kept node is named to the runtime by the call that makes its
output, as annotate saw it: the overload and its position among the segment's calls of that
overload (``("aten.mm.default", 2)``: the segment's third ``mm``). Forward and recompute make
those calls in the same order, so the position is stable; node names do not matter.

A node may be kept when keeping it cannot change what the step computes:

* it does not draw random numbers (a skipped dropout would shift the RNG stream of the recompute);
* it writes no buffer and nothing writes its output later (torch refuses a mutated cached tensor);
* it allocates its own output (a view keeps nothing).

Among those, the solver is offered the nodes with FLOPs (matmuls, convolutions, attention): the
ones expensive per byte to run again. Users pin by op: ``force={"op:aten.mm": "save"}`` keeps
every ``mm`` inside a segment (any strategy), ``"recompute"`` never keeps it.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Mapping, Optional, Sequence

import torch
import torch.fx

from fxckpt.passes.annotate import info
from fxckpt.passes.graph_view import SYNTHETIC
from fxckpt.solver import Problem

__all__ = ["OP_PREFIX", "op_pins", "module_pins", "Groups", "choices", "cached_calls"]

OP_PREFIX = "op:"
"""``force`` keys starting with this pin an aten op (``op:aten.mm`` or ``op:aten.mm.default``)."""

Groups = list[tuple[int, ...]]
"""Op positions of the solver's Problem kept together (a node and its hidden saved tensors)."""


def op_pins(force: Mapping[str, str]) -> dict[str, str]:
    """The op pins of ``force``: op name (without the prefix) -> ``save`` or ``recompute``."""
    return {k[len(OP_PREFIX):]: v for k, v in force.items() if k.startswith(OP_PREFIX)}


def module_pins(force: Mapping[str, str]) -> dict[str, str]:
    """The module pins of ``force`` (every key that is not an op pin)."""
    return {k: v for k, v in force.items() if not k.startswith(OP_PREFIX)}


def _pin(node: torch.fx.Node, pins: Mapping[str, str]) -> Optional[str]:
    """``recompute`` if any call of the node is pinned so, else ``save`` if any is, else None."""
    modes = {mode for call in info(node).calls for op, mode in pins.items()
             if call == op or call.rsplit(".", 1)[0] == op}
    return "recompute" if "recompute" in modes else ("save" if modes else None)


def _written(order: Sequence[torch.fx.Node]) -> set[str]:
    """Nodes whose output (or a view of it) some node writes in place."""
    by_name = {n.name: n for n in order}
    written: set[str] = set()
    for n in order:
        for target in info(n).mutates:
            written.add(target)
            if target in by_name:
                written.update(info(by_name[target]).aliases)
    return written


def _safe(node: torch.fx.Node, written: set[str]) -> bool:
    i = info(node)
    return (i.new_bytes > 0 and not i.random and not i.writes_buffers and not i.mutates
            and not i.aliases and node.name not in written)


def choices(problem: Problem, order: Sequence[torch.fx.Node],
            force: Mapping[str, str]) -> tuple[Groups, Groups]:
    """The groups the solver may keep, and those ``force`` makes it keep (inside segments)."""
    position = {op.name: k for k, op in enumerate(problem.ops)}
    pins, written = op_pins(force), _written(order)
    offered: Groups = []
    forced: Groups = []
    for n in order:
        pin = _pin(n, pins) if pins else None
        if n.name not in position or pin == "recompute" or not _safe(n, written):
            continue
        group = tuple(position[m] for m in (n.name + SYNTHETIC, n.name) if m in position)
        if pin == "save":
            forced.append(group)
        elif info(n).flops > 0:
            offered.append(group)
    return offered, forced


@functools.lru_cache(maxsize=None)
def _is_view(call: str) -> bool:
    """Whether the aten overload ``call`` (``aten.view.default``) returns a view."""
    namespace, _, rest = call.partition(".")
    name, _, overload = rest.rpartition(".")
    try:
        op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    except (AttributeError, RuntimeError):
        return False
    return bool(getattr(op, "is_view", False))


_CONVERSIONS = frozenset({"_to_copy", "clone", "contiguous", "copy_", "lift_fresh"})
"""Calls that convert or copy: autocast casts differ between forward and recompute (the forward
may reuse a cached cast), so they are never the call a kept node is found by."""


def _main_call(calls: Sequence[str]) -> Optional[int]:
    """Index of the call making the node's output: its last call that is not a view or a copy."""
    for k in range(len(calls) - 1, -1, -1):
        if not _is_view(calls[k]) and calls[k].split(".")[1] not in _CONVERSIONS:
            return k
    return None


def cached_calls(members: Sequence[torch.fx.Node],
                 keeps: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """The aten calls of a segment whose outputs the runtime keeps: each kept node's main call
    (:func:`_main_call`), as ``(overload, position among the segment's calls of it)``."""
    if not keeps:  # (a hand-made plan may lower an unannotated graph)
        return ()
    kept, counts = set(keeps), defaultdict(int)  # type: ignore[var-annotated]
    out = []
    for n in members:
        calls = info(n).calls
        main = _main_call(calls) if n.name in kept else None
        for k, call in enumerate(calls):
            if k == main:
                out.append((call, counts[call]))
            counts[call] += 1
    return tuple(out)
