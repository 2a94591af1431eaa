"""The rules every segment obeys, whichever strategy chose it.

* ``force`` pins win: ``"save"`` nodes leave their segments, ``"recompute"`` nodes form their own;
  a pin that cannot apply is explained in the plan's notes, never dropped silently.
* a segment never writes in place to a tensor it did not create (the first run would change
  what the recompute reads), so it starts after its last such write — repeatedly, since
  dropping a head can expose another one (:func:`safe`); parameters and buffers excepted
  (BatchNorm's statistics): a segment restores those around its recompute;
* a segment ends before any tensor that a later node writes in place: checkpoint checks the
  version counters of what it keeps and matches the outputs it recomputes (OLMo's
  ``query_states.clamp_()`` after its projection);
* modules with hooks (``hooked``) are never inside a segment: their hooks fire once per forward;
* a segment that frees nothing is dropped: it would cost a recompute and save no memory.
"""

from __future__ import annotations

import functools
import logging
from typing import Mapping, Optional, Sequence

import torch
import torch.fx

from fxckpt.cost.annotate import has_info, info
from fxckpt.cost.runs import Run

__all__ = [
    "apply_force",
    "contiguous",
    "safe",
    "frees_memory",
    "without_hooked",
    "without_mode_switches",
    "force_notes",
    "pinned",
]

log = logging.getLogger(__name__)


def pinned(n: torch.fx.Node, force: Mapping[str, str]) -> Optional[str]:
    """The mode of the innermost ``force`` path the node comes from, if any."""
    path = info(n).module_path
    best: Optional[tuple[str, str]] = None
    for p, mode in force.items():
        if _under(path, p) and (best is None or len(p) > len(best[0])):
            best = (p, mode)
    return best[1] if best else None


def apply_force(
    order: Sequence[torch.fx.Node], runs: list[Run], force: Mapping[str, str]
) -> list[Run]:
    """``save`` pins leave their runs; each ``recompute`` pin's nodes become runs of their own."""
    if not force:
        return runs
    free = [[n for n in r if pinned(n, force) is None] for r in runs]
    split = [piece for r in free for piece in contiguous(r, order)]
    forced = contiguous([n for n in order if pinned(n, force) == "recompute"], order)
    pos = {n: i for i, n in enumerate(order)}
    return sorted((r for r in split + forced if r), key=lambda r: pos[r[0]])


def contiguous(nodes: list[torch.fx.Node], order: Sequence[torch.fx.Node]) -> list[Run]:
    """``nodes`` (in order) split where they skip a node of ``order``."""
    pos = {n: i for i, n in enumerate(order)}
    runs: list[Run] = []
    for n in nodes:
        if runs and pos[n] == pos[runs[-1][-1]] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return runs


def safe(run: Run) -> Run:
    """The part of ``run`` checkpoint can recompute (see the module docstring)."""
    return _unwritten_prefix(_safe_suffix(run)) if run else run


def _safe_suffix(run: Run) -> Run:
    """Drop the head of a run up to its last in-place write to a tensor from outside it, until
    none."""
    graph_nodes = {n.name: n for n in run[0].graph.nodes} if run else {}
    while run:
        names = {n.name for n in run}
        last = -1
        for i, n in enumerate(run):
            if any(m not in names and not _is_state(graph_nodes[m]) for m in info(n).mutates):
                last = i
        if last < 0:
            return run
        log.debug("segment starting at %s writes to its input in %s; starts after it",
                  run[0].name, run[last].name)
        run = run[last + 1:]
    return run


def _is_state(node: torch.fx.Node) -> bool:
    """A parameter or buffer (a ``get_attr``, or a Dynamo graph's lifted placeholder): a segment
    that writes it restores it around its recompute."""
    return node.op == "get_attr" or (has_info(node) and info(node).is_state)


def _unwritten_prefix(run: Run) -> Run:
    """Cut a run before the first node whose tensors a later node writes in place."""
    if not run:
        return run
    members = set(run)
    order = list(run[0].graph.nodes)
    later = order[order.index(run[-1]) + 1:]
    written = {m for n in later if has_info(n) for m in info(n).mutates}
    if not written:
        return run
    for i, n in enumerate(run):
        read = [a for a in n.all_input_nodes if a not in members and _storage_of(a) in written]
        if read or _storage_of(n) in written:
            log.debug("segment starting at %s: %s is written in place after it; ends before %s",
                      run[0].name, (read[0] if read else n).name, n.name)
            return run[:i]
    return run


def _storage_of(node: torch.fx.Node) -> str:
    """The node owning the storage ``node``'s output lives in (itself unless it is a view)."""
    if not has_info(node):
        return node.name
    i = info(node)
    return i.aliases[0] if i.aliases and i.new_bytes == 0 else node.name


def frees_memory(run: Run) -> bool:
    """Would recomputing ``run`` free anything: a tensor used only inside it, or a leaf module's
    insides (what autograd keeps within ``nn.TransformerEncoderLayer`` and the like)?"""
    members = set(run)
    return any((info(n).new_bytes > 0 and all(u in members for u in n.users))
               or info(n).saves_internal_bytes > 0 for n in run)


def without_hooked(order: Sequence[torch.fx.Node], runs: list[Run],
                   hooked: Mapping[str, str]) -> tuple[list[Run], tuple[str, ...]]:
    """``runs`` without the ``hooked`` nodes, and a note per module that took out of a segment.
    """
    if not hooked:
        return runs, ()
    hit = sorted({hooked[n.name] for r in runs for n in r if n.name in hooked})
    notes = tuple(f"{path} has hooks: it runs as it is, outside recompute segments, so its hooks "
                  "fire once per forward" for path in hit)
    pieces = [
        piece for r in runs for piece in contiguous([n for n in r if n.name not in hooked], order)
    ]
    return [p for p in pieces if p and frees_memory(p)], notes


@functools.cache
def _mode_switches() -> frozenset[object]:
    """Functions a Dynamo graph calls to enter or leave a global mode, one node each end."""
    import torch.amp.autocast_mode as autocast
    import torch.autograd.grad_mode as grad_mode

    names = ((autocast, "_enter_autocast"), (autocast, "_exit_autocast"),
             (torch._C, "_set_grad_enabled"), (grad_mode, "_enter_inference_mode"),
             (grad_mode, "_exit_inference_mode"))
    return frozenset(getattr(owner, name) for owner, name in names if hasattr(owner, name))


def without_mode_switches(order: Sequence[torch.fx.Node], runs: list[Run]) -> list[Run]:
    """``runs`` split at the nodes that enter or leave autocast or a grad mode (a Dynamo graph's
    ``_enter_autocast`` ... ``_exit_autocast``). A segment holding one end would switch the mode
    again in its recompute, unbalanced (autocast's nesting count went below zero, and its cache
    of cast weights outlived the region); a segment between the ends runs in the mode, which
    torch's checkpoint restores for the recompute."""
    switches = _mode_switches()
    cut = {n for r in runs for n in r if n.op == "call_function" and n.target in switches}
    if not cut:
        return runs
    pieces = [p for r in runs for p in contiguous([n for n in r if n not in cut], order)]
    return [p for p in pieces if p and frees_memory(p)]


def force_notes(
    order: Sequence[torch.fx.Node], runs: list[Run], force: Mapping[str, str]
) -> tuple[str, ...]:
    """Why each module forced to recompute is not in a segment, if it is not."""
    in_runs = {n for r in runs for n in r}
    notes = []
    for path, mode in force.items():
        if mode != "recompute":
            continue
        nodes = [
            n
            for n in order
            if pinned(n, force) == "recompute" and _under(info(n).module_path, path)
        ]
        owner = next((o for o in opaque_modules(order) if _under(path, o[0]) and path != o[0]),
                     None)
        if not nodes and owner is not None:
            notes.append(
                f"force[{path!r}] = 'recompute' has no effect: it is inside {owner[0]} "
                f"({owner[1]}), which the captured graph runs as one op; force {owner[0]!r} "
                "instead"
            )
        elif not nodes:
            notes.append(
                f"force[{path!r}] = 'recompute' has no effect: no compute node of the captured "
                "graph comes from that module (is it called in forward?)"
            )
        elif not any(n in in_runs for n in nodes):
            notes.append(
                f"force[{path!r}] = 'recompute' has no effect: recomputing it would free nothing "
                "(every tensor it makes is used after it), or it has hooks"
            )
    return tuple(notes)


def opaque_modules(order: Sequence[torch.fx.Node]) -> list[tuple[str, str]]:
    """``(path, class name)`` of each module with children that the graph calls as one op (a
    leaf of the capture: its children are not in the graph)."""
    found: dict[str, str] = {}
    for n in order:
        if n.op != "call_module" or n.graph.owning_module is None:
            continue
        try:
            module = n.graph.owning_module.get_submodule(str(n.target))
        except AttributeError:
            continue
        if next(module.children(), None) is not None:
            found.setdefault(info(n).module_path or str(n.target), type(module).__name__)
    return list(found.items())


def _under(module_path: str, path: str) -> bool:
    return module_path == path or module_path.startswith(path + ".")
