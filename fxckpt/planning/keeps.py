"""Selective recompute, the graph side: which nodes a segment may keep, and how the runtime finds
their outputs again.

A segment normally runs every node again in backward. With selective recompute the planner keeps
some nodes' outputs from forward instead (:mod:`fxckpt.solver.selective` chooses which); the
runtime (:mod:`fxckpt.runtime.selective`) works as torch's selective checkpoint does, below
autograd, on the aten calls of each kept node, which lowering brackets with
``fxckpt_keep_begin(i)`` / ``fxckpt_keep_end(i, value)``.

A node may be kept when keeping it cannot change what the step computes:

* it does not draw random numbers (a skipped dropout would shift the RNG stream of the recompute);
* it writes no buffer and nothing writes its output later (torch refuses a mutated cached tensor);
* it allocates its own output (a view keeps nothing).

Among those, the solver is offered the nodes with FLOPs (matmuls, convolutions, attention) and the
memory-bound ones that cost at least :data:`KEEP_PRICE` per byte to run again (``tanh``, a
softmax, a layer norm): the ones expensive per byte to run again. Users pin by op:
``force={"op:aten.mm": "save"}`` keeps every ``mm`` inside a segment (any strategy),
``"recompute"`` never keeps it.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch
import torch.fx

from fxckpt.cost.annotate import NodeInfo, info
from fxckpt.cost.bridge import SYNTHETIC
from fxckpt.cost.prices import CALL_PRICE
from fxckpt.solver import Problem

__all__ = ["OP_PREFIX", "op_pins", "module_pins", "Groups", "choices", "op_kind"]

OP_PREFIX = "op:"
"""``force`` keys starting with this pin an aten op (``op:aten.mm`` or ``op:aten.mm.default``)."""

KEEP_PRICE = 16.0
"""Memory-bound nodes whose recompute costs at least this many FLOP-equivalents per byte they
keep are offered too (``tanh`` at 62, a layer norm at 22; not a ``mul`` at 3)."""

Groups = list[tuple[int, ...]]
"""Op positions of the solver's Problem kept together (a node and its hidden saved tensors)."""


_VIEWS = frozenset({"view", "_unsafe_view", "t", "expand", "reshape", "permute", "transpose",
                    "unsqueeze", "squeeze", "slice", "select", "alias", "detach", "split",
                    "as_strided", "unbind", "chunk", "contiguous", "clone", "sym_size"})


def op_kind(n: torch.fx.Node) -> str:
    """The op a node is about: its last aten op that is not a view (``""`` for views)."""
    ops = [op for op in (c.split(".")[1] for c in info(n).calls) if op not in _VIEWS]
    return ops[-1] if ops else ""


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


def _dear(i: NodeInfo) -> bool:
    """A memory-bound node whose bytes cost at least :data:`KEEP_PRICE` each to write again
    (the calls' fixed price left out: a tiny node is never worth keeping)."""
    return i.work - CALL_PRICE * len(i.calls) >= KEEP_PRICE * i.new_bytes > 0


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
        elif info(n).flops > 0 or _dear(info(n)):
            offered.append(group)
    return offered, forced
