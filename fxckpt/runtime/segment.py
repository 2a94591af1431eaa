"""Segments: the modules the runtime checkpoints, with what it needs to know about them as fields.

The checkpoint runtime names the module it recomputes (in logs and in the recompute check's
messages) and puts back the buffers it writes in place while it recomputes; the offload runtime
runs a segment under the hooks of the offloader its owner attached. Those facts are typed fields
of the module the runtime is handed, set by whoever builds it:

    Recomputable            name, restores          a module checkpointed as a whole
    ├── Segment             + offloader             a lowered ``segment_N`` GraphModule
    ├── pipeline._Stage                             one stage of the local pipeline
    └── distributed._Recomputed                     a stage of a distributed pipeline

``restores`` are buffer names relative to the module itself (``layers.0.bn.running_mean``).
A :class:`Segment` is a ``torch.fx.GraphModule`` (``segment_0.code`` reads its code), so its
own attribute names share a namespace with the model's attributes the segment reads: the
tracer renames a model attribute called ``name``, ``restores`` or ``offloader`` (a child or a
parameter the graph reads) as it renames ``graph`` or ``code`` (see :data:`SEGMENT_FIELDS`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.fx
import torch.nn as nn

if TYPE_CHECKING:
    from fxckpt.runtime.offload import Offloader

__all__ = ["Recomputable", "Segment", "SEGMENT_FIELDS", "segment_of"]

SEGMENT_FIELDS = ("name", "restores", "offloader", "restored_buffers", "kept")
"""Attribute names a :class:`Segment` owns (a model's attribute of that name is renamed)."""


class Recomputable(nn.Module):
    """A module the checkpoint runtime recomputes as a whole, knowing its name and its state.

    Subclasses set both fields in ``__init__``.
    """

    name: str
    """Names the module in logs and recompute mismatches (``segment_0``, ``pipeline stage 1``)."""
    restores: tuple[str, ...]
    """Buffers (relative names) the module writes in place, restored around its recompute."""

    def restored_buffers(self) -> list[torch.Tensor]:
        """The buffers named by ``restores``, in that order."""
        return [self.get_buffer(name) for name in self.restores]


class Segment(torch.fx.GraphModule, Recomputable):
    """A lowered segment: a GraphModule sharing the model's tensors, and the runtime's fields."""

    offloader: Optional["Offloader"] = None
    """Set for a segment the plan offloads: its forward runs under these saved-tensor hooks."""

    kept: int = 0
    """How many nodes of the segment keep their output from forward (selective recompute: their
    code is bracketed by ``fxckpt_keep_begin`` / ``fxckpt_keep_end``)."""

    def __init__(self, root: nn.Module, graph: torch.fx.Graph, *, name: str,
                 restores: tuple[str, ...] = (), kept: int = 0) -> None:
        super().__init__(root, graph, class_name="Segment")
        self.name = name
        self.restores = tuple(restores)
        self.kept = int(kept)

    def __deepcopy__(self, memo: dict[int, object]) -> "Segment":
        if self.offloader is not None:  # a policy object with streams and a pool: shared
            memo[id(self.offloader)] = self.offloader
        res = super().__deepcopy__(memo)
        assert isinstance(res, Segment)  # GraphModule.__deepcopy__ makes an instance of our class
        res.name, res.restores, res.kept = self.name, self.restores, self.kept
        res.offloader = self.offloader
        return res


def segment_of(module: nn.Module, path: str) -> Segment:
    """The segment at ``path`` under ``module`` (a rewritten graph's ``segment_N``)."""
    segment = module.get_submodule(path)
    if not isinstance(segment, Segment):
        raise TypeError(f"{path!r} is a {type(segment).__name__}, not a lowered fxckpt Segment")
    return segment
