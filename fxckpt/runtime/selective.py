"""Selective recompute at run time: keep some aten calls' outputs from a segment's forward and
hand them to its recompute instead of running those calls again.

A segment lowered with ``cached`` calls (``("aten.addmm.default", 1)``: its second ``addmm``)
runs its forward under :class:`_Store` and its recompute under :class:`_Reuse`. Both sit below
autograd (torch dispatch modes), as torch's own selective checkpoint does: autograd records the
op and what its backward saves as usual, and only the kernel is skipped in the recompute.

Why not ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` itself: its recompute
refuses any call the forward did not make the same number of times. Under autocast the two runs
differ in calls we never keep (the forward reuses autocast's cached bf16 weight casts; the
recompute, in a fresh autocast region, casts again), and torch's contexts then fail. Here calls
are counted per overload, so a kept ``addmm`` is found by its place among the ``addmm`` calls
whatever else differs, and every call not kept simply runs. As in torch, a kept tensor written in
place between forward and recompute is an error, and a region can be recomputed once.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["keep_contexts", "IGNORED"]

IGNORED = frozenset(str(op) for op in getattr(
    torch_checkpoint, "SAC_IGNORED_OPS", {torch.ops.aten.detach.default}))
"""Calls not counted (``detach``, which checkpoint itself adds in different numbers), the same
set annotate leaves out when it records a node's calls."""


class _Counted(TorchDispatchMode):
    def __init__(self, store: dict[tuple[str, int], Any], name: str) -> None:
        super().__init__()
        self.store, self.name = store, name
        self.seen: dict[str, int] = {}

    def _key(self, func: Any) -> Optional[tuple[str, int]]:
        op = str(func)
        if op in IGNORED:
            return None
        k = self.seen.get(op, 0)
        self.seen[op] = k + 1
        return op, k


class _Store(_Counted):
    """Forward: run every call; keep the outputs of the calls named ``cached`` (detached, with
    their version counters)."""

    def __init__(self, store: dict[tuple[str, int], Any], cached: frozenset[tuple[str, int]],
                 name: str) -> None:
        super().__init__(store, name)
        self.cached = cached

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        key = self._key(func)
        if key in self.cached:
            leaves, spec = pytree.tree_flatten(out)
            leaves = [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves]
            versions = [t._version if isinstance(t, torch.Tensor) else None for t in leaves]
            self.store[key] = (leaves, versions, spec)
        return out


class _Reuse(_Counted):
    """Recompute: a kept call returns its stored output (once); every other call runs."""

    def __enter__(self) -> Any:
        self.seen = {}  # counted afresh for each recompute
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        key = self._key(func)
        if key is None or key not in self.store:
            return func(*args, **(kwargs or {}))
        kept = self.store.pop(key)
        if kept is None:
            raise RuntimeError(
                f"{self.name}: backward ran through a segment with kept outputs a second time; "
                "selective recompute keeps each output for one backward (use selective=False "
                "for retain_graph=True)")
        self.store[key] = None
        leaves, versions, spec = kept
        for t, version in zip(leaves, versions):
            if isinstance(t, torch.Tensor) and t._version != version:
                raise RuntimeError(
                    f"{self.name}: the output of {key[0]} (call {key[1]}) kept for the "
                    "recompute was written in place after the forward; its value would be wrong")
        return pytree.tree_unflatten(leaves, spec)


def keep_contexts(cached: frozenset[tuple[str, int]], name: str) -> tuple[_Store, _Reuse]:
    """The forward and recompute modes of one checkpointed call of a segment."""
    store: dict[tuple[str, int], Any] = {}
    return _Store(store, cached, name), _Reuse(store, name)
