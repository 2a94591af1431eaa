"""Selective recompute at run time: keep some nodes' outputs from a segment's forward and hand
them to its recompute instead of running those nodes' main op again.

The lowered segment brackets each kept node with two calls::

    fxckpt_keep_begin(0)
    addmm = torch.ops.aten.addmm.default(bias, x, weight)
    addmm_kept = fxckpt_keep_end(0, addmm)

Between them a torch dispatch mode sits below autograd, as in torch's own selective checkpoint
(autograd records the op and what its backward saves as usual; only the kernel is skipped):

* in the segment's first run (:class:`Keeper` in its forward phase) it runs every call and keeps
  the output of the node's *main* call: its last call that is not a view or a copy (``addmm``,
  not the ``t`` before it nor a cast);
* in the recompute it runs every call but the main one, whose kept output it returns.

The mode is active for the kept node only (one or a few aten calls), not for the whole segment:
a mode over every call of a segment cost about 8% of a GPT-2 step on the benchmark CPU. Calls are
counted per node, so the two runs may differ in calls that are never kept (autocast's cached weight
casts). Outside a checkpointed run (eval, ``no_grad``, ``torch.compile``) the brackets do
nothing. As in torch, a kept tensor written in place before the recompute is an error, and a
segment with kept outputs can be backpropagated through once.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Keeper", "keep_begin", "keep_end", "active"]

_local = threading.local()
_COPIES = frozenset({"_to_copy", "clone", "contiguous", "copy_", "lift_fresh", "detach",
                     "_unsafe_view", "_reshape_alias"})
"""Calls that only copy, cast or re-view another call's output. ``_unsafe_view`` is not marked
as a view but returns one: ``linear`` on a 3-d input is ``view``, ``mm``, ``_unsafe_view``, and
the ``mm`` is what must be kept (keeping the ``_unsafe_view`` left the ``mm`` to run again)."""


def _is_copy(func: Any) -> bool:
    return func.overloadpacket.__name__ in _COPIES and not getattr(func, "is_view", False)


def _is_main_candidate(func: Any) -> bool:
    """Calls that can make a node's output: not views, not copies or casts, and not ``prim``
    queries (``prim.device``, which fake tensors answer through the dispatcher: counting them
    made the fake verification keep a device, and count nothing kept)."""
    return (not getattr(func, "is_view", False) and func.overloadpacket.__name__ not in _COPIES
            and getattr(func, "namespace", "") != "prim")


_GUARD = getattr(torch._C, "_SetExcludeDispatchKeyGuard", None)


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()`` that shares ``t``'s version counter, so a later in-place write to the kept
    output is seen. Below autograd (in a dispatch mode) the ADInplaceOrView key that shares it is
    excluded; it is let through for the detach, as torch's selective checkpoint does."""
    if _GUARD is None:  # pragma: no cover - other torch versions
        return t.detach()
    with _GUARD(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


class _Record(TorchDispatchMode):
    """Forward: run the node's calls; remember the last candidate's output and its position.
    A node with no candidate (a cast, ``x.to(torch.float32)``, is a copy only) keeps its last
    copy's output instead (:attr:`kept`), found by its position among the node's copies."""

    def __init__(self) -> None:
        super().__init__()
        self.count = self.copies = 0
        self.last: Optional[tuple] = None
        self.last_copy: Optional[tuple] = None

    @property
    def kept(self) -> Optional[tuple]:
        return self.last if self.last is not None else self.last_copy

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        candidate = _is_main_candidate(func)
        if candidate or _is_copy(func):
            leaves, spec = pytree.tree_flatten(out)
            if any(isinstance(t, torch.Tensor) for t in leaves):
                leaves = [_detached(t) if isinstance(t, torch.Tensor) else t for t in leaves]
                versions = [t._version if isinstance(t, torch.Tensor) else None for t in leaves]
                if candidate:
                    self.last = (self.count, str(func), leaves, versions, spec, False)
                else:
                    self.last_copy = (self.copies, str(func), leaves, versions, spec, True)
            if candidate:
                self.count += 1
            else:
                self.copies += 1
        return out


class _Replay(TorchDispatchMode):
    """Recompute: run the node's calls, but return the kept output for its main call."""

    def __init__(self, kept: tuple, where: str) -> None:
        super().__init__()
        self.kept, self.where, self.count = kept, where, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        position, name, leaves, versions, spec, copy = self.kept
        if not (_is_copy(func) if copy else _is_main_candidate(func)):
            return func(*args, **(kwargs or {}))
        k, self.count = self.count, self.count + 1
        if k != position or str(func) != name:
            return func(*args, **(kwargs or {}))
        for t, version in zip(leaves, versions):
            if isinstance(t, torch.Tensor) and t._version != version:
                raise RuntimeError(
                    f"{self.where}: the output of {name} kept for the recompute was written in "
                    "place after the forward; its value would be wrong")
        return pytree.tree_unflatten(leaves, spec)


class Keeper:
    """The kept outputs of one checkpointed call of a segment, and the phase it is in."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.phase = "idle"
        self.kept: dict[int, Optional[tuple]] = {}
        self.mode: Optional[TorchDispatchMode] = None

    def enter(self, phase: str) -> None:
        self.outer, self.phase = getattr(_local, "keeper", None), phase
        _local.keeper = self

    def leave(self) -> None:
        if self.mode is not None:  # a node raised between its brackets
            self.mode.__exit__(None, None, None)
            self.mode = None
        _local.keeper, self.phase = self.outer, "idle"

    def begin(self, index: int) -> None:
        if self.phase == "forward":
            self.mode = _Record()
        else:
            kept = self.kept.get(index)
            if kept is None:
                raise RuntimeError(
                    f"{self.name}: backward ran through a segment with kept outputs a second "
                    "time; selective recompute keeps each output for one backward (use "
                    "selective=False for retain_graph=True)")
            self.kept[index] = None
            self.mode = _Replay(kept, self.name)
        self.mode.__enter__()

    def end(self, index: int) -> None:
        mode, self.mode = self.mode, None
        assert mode is not None
        mode.__exit__(None, None, None)
        if isinstance(mode, _Record) and mode.kept is not None:
            self.kept[index] = mode.kept


def active() -> Optional[Keeper]:
    """The keeper of the segment run in progress on this thread, if any."""
    return getattr(_local, "keeper", None)


def keep_begin(index: int) -> None:
    """Generated code calls this just before a kept node (see the module docstring)."""
    keeper = active()
    if keeper is not None:
        keeper.begin(index)


def keep_end(index: int, value: Any) -> Any:
    """Generated code calls this just after a kept node, with the node's value; returns it."""
    keeper = active()
    if keeper is not None:
        keeper.end(index)
    return value


keep_begin.__module__ = keep_end.__module__ = "fxckpt"
