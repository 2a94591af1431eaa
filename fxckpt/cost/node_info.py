"""The record annotate leaves on every node: :class:`NodeInfo`, and how to read it.

:mod:`fxckpt.cost.annotate` runs a graph on fake tensors and stores one :class:`NodeInfo` per
node under ``node.meta[META_KEY]``; the strategies, the simulator's bridge, lowering and the
pictures read it through :func:`info`. The record is plain data; writing it is annotate's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx

from fxckpt.errors import PlanError

__all__ = ["META_KEY", "NodeInfo", "info", "has_info", "module_path_of", "model_stack"]

META_KEY = "fxckpt"


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """What annotate learned about one node."""

    module_path: str
    """Dotted path of the innermost module the node ran in (``""`` for the root)."""
    shapes: tuple[tuple[int, ...], ...]
    """Shapes of the tensors the node outputs."""
    dtypes: tuple[str, ...]
    device: str | None
    nbytes: int
    """Bytes of all output tensors (views counted at their own size)."""
    new_bytes: int
    """Bytes of output storages no earlier node owns (what the node really allocates)."""
    aliases: tuple[str, ...]
    """Earlier nodes whose storage an output of this node shares (view or in-place result)."""
    mutates: tuple[str, ...]
    """Earlier nodes whose tensors this node writes in place."""
    writes_buffers: tuple[str, ...]
    """Buffers and parameters (qualified names) the node writes in place, e.g. BatchNorm running
    statistics, or an EMA teacher's weights updated under ``no_grad``."""
    saves: tuple[str, ...]
    """Nodes (this one included) whose tensors autograd keeps for this node's backward."""
    saves_internal_bytes: int
    """Bytes autograd keeps for this node that no node outputs (dropout masks, a module's
    insides)."""
    random: bool
    """The node draws random numbers (dropout, rand*, bernoulli, ...)."""
    flops: int
    is_tensor: bool
    """At least one output is a tensor."""
    is_state: bool
    """A ``get_attr`` of a parameter or buffer."""
    ops: tuple[str, ...]
    """The aten ops the node ran (not ``prim`` queries such as ``prim.device``)."""
    work: float = 0.0
    """FLOP-equivalents of the node's calls beyond their FLOPs: a fixed price per call and the
    bytes memory-bound calls write, at their op's price (:mod:`fxckpt.cost.prices`)."""
    priced: tuple[tuple[str, float], ...] = ()
    """The node's calls as price terms, amounts summed by key: each CPU call that can be made
    again as its own key (:mod:`fxckpt.cost.timed_calls`, timed where the plan is made:
    :mod:`fxckpt.cost.cpu_table`), the others as their :func:`~fxckpt.cost.prices.price_terms`
    (bytes at an op's price)."""
    calls: tuple[str, ...] = ()
    """The aten op overloads the node dispatched (``aten.mm.default``), in order, without
    bookkeeping ops that make no value (``detach``, ``prim.device``): what ``force``'s op pins
    match (:mod:`fxckpt.planning.keeps`) and the plan tables name."""
    scratch: int = 0
    """Most bytes one of the node's kernels, or its backward, allocates for itself while it runs
    (a CPU convolution's reorder buffers: :mod:`fxckpt.cost.scratch`)."""
    moved: int = 0
    """Bytes the node's calls read and write (views excluded): the memory traffic a device
    profile prices (:mod:`fxckpt.cost.devices`)."""
    saved_count: int = 0
    """Tensors autograd saved for the node's backward (weights included): in a segment, each
    goes through the checkpoint's saved-tensor hooks."""


def has_info(node: torch.fx.Node) -> bool:
    """True when annotate recorded a :class:`NodeInfo` for the node (every node but the output)."""
    return META_KEY in node.meta


def info(node: torch.fx.Node) -> NodeInfo:
    """The node's annotation; raises :class:`PlanError` if annotate has not run on its graph."""
    try:
        return node.meta[META_KEY]
    except KeyError:
        raise PlanError(
            f"node {node.format_node()} has no fxckpt annotation; run annotate first"
        ) from None


def module_path_of(node: torch.fx.Node) -> str:
    """The dotted module path a node came from, for symbolic and exported graphs alike."""
    target = str(node.meta.get("fxckpt_path", node.target))  # see capture.tracer.to_graph_module
    if node.op == "call_module":
        return target
    if node.op == "get_attr":
        return target.rpartition(".")[0]
    stack = model_stack(node)
    if not stack:
        return ""
    path = stack[-1][0]
    if path.startswith(_NO_STACK):  # torch's name for a node export left without a stack
        return ""
    return _normalise_path(path)


def model_stack(node: torch.fx.Node) -> list[tuple[str, Any]]:
    """The node's ``nn_module_stack`` entries (path, class), outermost first, less the modules
    Dynamo reached as a global (``G['module'].name``): a module object a library keeps at module
    level is not part of the model, and a node it ran belongs to the model's module that called
    it. transformers 5.25 made ``apply_rotary_pos_emb`` such a module (a hub-kernel wrapper):
    read as the innermost module, it cut every Llama layer into three by module path."""
    stack = node.meta.get("nn_module_stack") or {}
    return [entry for entry in stack.values() if not str(entry[0]).startswith("G[")]


_NO_STACK = "_empty_nn_module_stack"
"""The path torch.export's metadata hook gives a node it found no module stack for."""


def _normalise_path(path: str) -> str:
    """``L['self'].layers[0].fc`` or ``layers.0.fc`` -> ``layers.0.fc`` (``L['args'][0]``: a
    Dynamo frame that takes the module positionally, as a compiled ``nn.Sequential.forward``;
    ``__dict__['_modules']['model']``: a child Dynamo reached through ``__getattr__``, as PEFT's
    wrappers reach their base model)."""
    for prefix in ("L['self'].", "L['self']", "L['args'][0].", "L['args'][0]", "self."):
        if path.startswith(prefix):
            path = path[len(prefix):]
    parts = path.replace("[", ".").replace("]", "").replace("'", "").strip(".").split(".")
    return ".".join(p for p in parts if p not in ("__dict__", "_modules"))
