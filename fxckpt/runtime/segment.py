"""Segments: the modules the runtime checkpoints, with what it needs to know about them as fields.

The checkpoint runtime names the module it recomputes (in logs and in the recompute check's
messages) and puts back the buffers it writes in place while it recomputes; the offload runtime
runs a segment under the hooks of the offloader its owner attached. Those facts are typed fields
of the module the runtime is handed, set by whoever builds it:

    Recomputable            name, restores          a module checkpointed as a whole
    ├── SegmentModule       + offloader             a lowered ``segment_N`` GraphModule
    ├── pipeline._Stage                             one stage of the local pipeline
    └── distributed._Recomputed                     a stage of a distributed pipeline

``restores`` are buffer names relative to the module itself (``layers.0.bn.running_mean``).
A :class:`SegmentModule` is a ``torch.fx.GraphModule`` (``segment_0.code`` reads its code), so its
own attribute names share a namespace with the model's attributes the segment reads: the
tracer renames a model attribute called ``name``, ``restores`` or ``offloader`` (a child or a
parameter the graph reads) as it renames ``graph`` or ``code`` (see :data:`SEGMENT_FIELDS`).
"""

from __future__ import annotations

import sys
import traceback
from typing import Any, ContextManager, Optional, Protocol

import torch
import torch.fx
import torch.nn as nn
import torch.utils.checkpoint
from torch.fx.graph import PythonCode

__all__ = ["Recomputable", "SegmentModule", "SEGMENT_FIELDS", "NO_EARLY_STOP", "segment_of",
           "Offloading"]


class Offloading(Protocol):
    """What a segment needs of its offloader (:class:`fxckpt.runtime.offload.Offloader`, which
    imports this module: the protocol keeps the dependency one way)."""

    def hooks(self, module: torch.nn.Module, new_step: bool = True) -> ContextManager[Any]:
        """Saved-tensor hooks for a forward of ``module``."""

    def simulating(self, module: torch.nn.Module) -> ContextManager[Any]:
        """The same on fake or meta tensors: nothing moves, what would is off the device."""

# The exception checkpoint raises to stop a recompute early (a private name: if it moves, no
# exception is let through and fx's wrapper handles all of them, as before).
_STOP: Any = getattr(torch.utils.checkpoint, "_StopRecomputationError", ())

NO_EARLY_STOP = frozenset({"rrelu_with_noise"})
"""aten ops that torch's checkpoint early stop gets wrong. ``rrelu_with_noise`` saves its
``noise`` tensor before writing the noise into it; a recompute that stops right after the save
hands backward an unwritten tensor, and the gradient comes out NaN or inf
(pytorch/pytorch#193671). A segment running one recomputes to its end."""

SEGMENT_FIELDS = ("name", "restores", "offloader", "restored_buffers", "kept", "generators",
                  "early_stop", "draws", "restored_inputs", "forward_cost")
"""Attribute names a :class:`SegmentModule` owns (a model's attribute of that name is renamed)."""


class Recomputable(nn.Module):
    """A module the checkpoint runtime recomputes as a whole, knowing its name and its state.

    Subclasses set both fields in ``__init__``.
    """

    name: str
    """Names the module in logs and recompute mismatches (``segment_0``, ``pipeline stage 1``)."""
    restores: tuple[str, ...]
    """Buffers and parameters (relative names) the module writes in place, restored around its
    recompute."""

    def restored_buffers(self) -> list[torch.Tensor]:
        """The buffers (or parameters) named by ``restores``, in that order."""
        return [_state(self, name) for name in self.restores]


class SegmentModule(torch.fx.GraphModule, Recomputable):
    """A lowered segment: a GraphModule sharing the model's tensors, and the runtime's fields."""

    offloader: Optional[Offloading] = None
    """Set for a segment the plan offloads: its forward runs under these saved-tensor hooks."""

    kept: int = 0
    """How many nodes of the segment keep their output from forward (selective recompute: their
    code is bracketed by ``fxckpt_keep_begin`` / ``fxckpt_keep_end``)."""

    generators: tuple[torch.Generator, ...] = ()
    """Generators of the model's own the segment draws from (``torch.randn(..., generator=g)``):
    their states are replayed in the recompute, as torch's checkpoint replays the global ones."""

    early_stop: bool = True
    """Whether the recompute may stop once it has what backward needs (torch's early stop); off
    for segments running ops that early stop gets wrong (see :data:`NO_EARLY_STOP`)."""

    restored_inputs: tuple[int, ...] = ()
    """Positions of inputs that are state written in place (a Dynamo graph's buffers arrive as
    inputs): set back, around the recompute, to what the first run read, like ``restores``."""

    draws: bool = True
    """Whether the segment draws from torch's global generators (dropout, ``rand*``): only then
    are their states saved in forward and set again for the recompute. A segment that draws
    nothing leaves them alone, so the recompute never rewinds another thread's draws."""

    compiled_keeps: frozenset[str] = frozenset()
    """Aten ops whose outputs a compiled recompute keeps (``SegmentSpec.compiled_keeps``)."""

    forward_cost: float = 0.0
    """What the plan prices one forward run of the segment at (FLOP-equivalents; 0 when not
    known, as in a loaded module): what a :mod:`~fxckpt.runtime.clock` compares its time with."""

    def __init__(self, root: nn.Module, graph: torch.fx.Graph, *, name: str,
                 restores: tuple[str, ...] = (), kept: int = 0,
                 generators: tuple[torch.Generator, ...] = (), early_stop: bool = True,
                 draws: bool = True, offloader: Optional[Offloading] = None,
                 forward_cost: float = 0.0, compiled_keeps: tuple[str, ...] = ()) -> None:
        super().__init__(root, graph, class_name="SegmentModule")
        self.offloader = offloader
        self.name = name
        self.restores = tuple(restores)
        self.kept = int(kept)
        self.generators = tuple(generators)
        self.early_stop = bool(early_stop)
        self.draws = bool(draws)
        self.forward_cost = float(forward_cost)
        self.compiled_keeps = frozenset(compiled_keeps)

    def recompile(self) -> PythonCode:
        code = super().recompile()
        cls = type(self)  # each GraphModule has a class of its own; fx keeps its wrapper there
        wrapped = vars(cls).get("_wrapped_call")
        if wrapped is not None and not isinstance(wrapped, _StopPassesThrough):
            cls._wrapped_call = _StopPassesThrough(wrapped)  # type: ignore[attr-defined]
        return code

    def __deepcopy__(self, memo: dict[int, object]) -> "SegmentModule":
        if self.offloader is not None:  # a policy object with streams and a pool: shared
            memo[id(self.offloader)] = self.offloader
        res = super().__deepcopy__(memo)
        assert isinstance(res, SegmentModule)  # GraphModule.__deepcopy__ makes one of our class
        res.name, res.restores, res.kept = self.name, self.restores, self.kept
        res.generators, res.early_stop, res.draws = self.generators, self.early_stop, self.draws
        res.restored_inputs, res.forward_cost = self.restored_inputs, self.forward_cost
        res.offloader = self.offloader
        return res


class _StopPassesThrough:
    """fx's call wrapper for a :class:`SegmentModule`: checkpoint's early stop passes untouched.

    torch's non-reentrant checkpoint ends a recompute as soon as it has every tensor it saves, by
    raising an exception out of the segment. fx's wrapper catches every exception leaving a
    GraphModule and extracts its traceback (``linecache`` checks each file: a ``stat`` per
    frame) to print the generated line on error: about 0.1 ms on every recompute of every
    segment. Other exceptions get fx's treatment, as in ``torch.fx.graph_module._WrappedCall``.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, obj: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return nn.Module.__call__(obj, *args, **kwargs)
        except _STOP:
            raise
        except Exception as e:
            frames = traceback.extract_tb(e.__traceback__)
            if frames and "eval_with_key" in frames[-1].filename:  # raised by generated code
                print(self.inner._generate_error_message(frames[-1]), file=sys.stderr)
                raise e.with_traceback(None)  # noqa: B904 (as fx does)
            raise


def _state(module: nn.Module, name: str) -> torch.Tensor:
    """The buffer ``name`` of ``module``, or its parameter of that name."""
    owner, _, attr = name.rpartition(".")
    holder = module.get_submodule(owner) if owner else module
    if attr in holder._buffers:
        return module.get_buffer(name)
    return module.get_parameter(name)


def segment_of(module: nn.Module, path: str) -> SegmentModule:
    """The segment at ``path`` under ``module`` (a rewritten graph's ``segment_N``)."""
    segment = module.get_submodule(path)
    if not isinstance(segment, SegmentModule):
        raise TypeError(
            f"{path!r} is a {type(segment).__name__}, not a lowered fxckpt SegmentModule")
    return segment
