"""Grad-mode and autocast regions, and random draws, kept in a symbolically traced graph.

``torch.fx.symbolic_trace`` records tensor operations only. Three things a forward does with
torch's *state* would be lost, each a silent divergence from the model:

* ``with torch.no_grad():`` (or ``@torch.no_grad()`` helpers, ``torch.set_grad_enabled(False)``):
  the traced graph would let gradients flow through what the model made a constant (an EMA
  teacher, a DINO centre, a VQ-VAE codebook update);
* ``with torch.autocast(...)`` islands inside forward (a bf16 block, or ``enabled=False``
  around an fp32 softmax): the graph would run them in the caller's precision;
* random numbers drawn without a traced input (``torch.randn(4, 16)``, ``torch.rand([])``):
  drawn once while tracing and baked into the graph as a constant.

:class:`StateRecorder` is the torch-function mode the tracer runs under (thread-local, nothing
is patched): it records grad-mode and autocast changes as nodes, and turns random factory calls
into graph nodes, so each call draws afresh. :func:`outline_regions` then makes every
grad-mode or autocast region one node, as ``torch.export`` does, running a submodule under the
mode with torch's own wrappers:

    h = self.a(x)                                    h = self.a(x)
    _set_grad_enabled(False)                         b_weight = self.b.weight  (hoisted)
    t = self.b(h)                          ==>       region = wrap_with_set_grad_enabled(
    _set_grad_enabled(True)                              False, self.grad_region_0, h)
    out = h * t                                      t = region[0]; out = h * t

A region is one unit for every later pass: segments and pipeline stages never cut through it,
and a region inside a recomputed segment runs under its mode again. A forward that draws real
random numbers while tracing anyway (a random tensor turned into a Python decision, LayerDrop's
``if torch.rand([]) < p``) cannot be a graph: :class:`StateRecorder` notes the draw and capture
refuses (or falls back to ``torch.export``, which refuses data-dependent decisions too).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, Optional

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import PreDispatchTorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from fxckpt.errors import CaptureError, grad_mode_left
from fxckpt.capture.graphs import subgraph
from fxckpt.runtime.state import TensorValues

__all__ = ["StateRecorder", "outline_regions", "RANDOM_FACTORIES", "is_region_marker"]

_SET_GRAD = torch._C._set_grad_enabled
_ENTER = torch.amp.autocast_mode._enter_autocast
_EXIT = torch.amp.autocast_mode._exit_autocast

RANDOM_FACTORIES: frozenset[Callable[..., Any]] = frozenset({
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal, torch.bernoulli,
    torch.poisson, torch.multinomial, torch.rand_like, torch.randn_like, torch.randint_like,
})
"""torch functions that draw random numbers; traced as nodes even when no input is traced."""


def is_region_marker(node: torch.fx.Node) -> bool:
    """A grad-mode or autocast change recorded by :class:`StateRecorder` (before outlining)."""
    return node.op == "call_function" and node.target in (_SET_GRAD, _ENTER, _EXIT)


class StateRecorder(PreDispatchTorchFunctionMode):
    """Records grad-mode and autocast changes and random draws into a tracer's graph.

    A subclass of torch's pre-dispatch mode only because ``torch.autocast`` reports its entry
    and exit to modes of that type alone; nothing of the base class runs.
    """

    def __init__(self, tracer: torch.fx.Tracer, state: Iterable[torch.Tensor] = ()) -> None:
        # no super(): see the class docstring
        self.tracer = tracer  # type: ignore[assignment]
        self.entered: list[torch.fx.Node] = []
        self.draws = _RealOps(state)

    def __enter__(self) -> "StateRecorder":
        super().__enter__()
        self.draws.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)  # first: putting state back must not be recorded
        self.draws.__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is _SET_GRAD:
            self.tracer.create_node("call_function", _SET_GRAD, tuple(args), {})
            return func(*args)
        if func is _ENTER:  # torch.autocast.__enter__ has already set the state
            node = self.tracer.create_node("call_function", _ENTER, tuple(args), {})
            self.entered.append(node)
            return node
        if func is _EXIT:  # torch.autocast.__exit__ restores the state itself
            self.tracer.create_node("call_function", _EXIT, (self.entered.pop(),), {})
            return None
        if func in RANDOM_FACTORIES and not _traced(args, kwargs):
            return self.tracer.create_proxy("call_function", func, tuple(args), kwargs)
        return func(*args, **kwargs)

    @property
    def drew(self) -> list[str]:
        """Random aten ops that ran on real tensors while tracing (baked into the graph)."""
        return self.draws.seen

    @property
    def wrote(self) -> list[str]:
        """aten ops that wrote the model's parameters or buffers while tracing (left out of the
        graph: ``for p in self.teacher.parameters(): p.mul_(0.99)`` reads real tensors)."""
        return self.draws.wrote


class _RealOps(TorchDispatchMode):
    """Notes what runs on real tensors while tracing (a traced op never reaches dispatch): random
    draws, and in-place writes to the model's state, which it puts back on exit."""

    def __init__(self, state: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.state = {_storage(t) for t in state} - {None, 0}
        self.seen: list[str] = []
        self.wrote: list[str] = []
        self.saved = TensorValues()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.seen.append(str(func.overloadpacket.__name__))
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
            for t in pytree.tree_leaves(value):
                if isinstance(t, torch.Tensor) and _storage(t) in self.state:
                    self.wrote.append(str(func.overloadpacket.__name__))
                    self.saved.add([t])
        return func(*args, **kwargs)

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.saved.restore()


def _storage(t: torch.Tensor) -> Optional[int]:
    """Where ``t``'s storage lives; None for a tensor without one of its own (an FSDP ``DTensor``
    parameter is a wrapper: its shard is what the hooks write, inside the opaque module)."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


def _traced(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(a, torch.fx.Proxy) for a in pytree.tree_leaves((args, kwargs)))


def outline_regions(gm: torch.fx.GraphModule) -> int:
    """Replace each grad-mode or autocast region of ``gm``'s graph by one wrapper node running a
    submodule under that mode; returns how many regions there were."""
    regions = 0
    while True:
        span = _first_region(gm.graph)
        if span is None:
            break
        _outline(gm, *span, index=regions)
        regions += 1
    if regions:
        gm.graph.lint()
        gm.recompile()
    return regions


def _first_region(graph: torch.fx.Graph) -> Optional[tuple[list[torch.fx.Node], tuple]]:
    """The first region's nodes (its markers included) and how to enter its mode."""
    nodes = list(graph.nodes)
    ambient = True  # captures for training run with grad enabled
    for i, node in enumerate(nodes):
        if node.op != "call_function":
            continue
        if node.target is _SET_GRAD:
            if bool(node.args[0]) == ambient:
                graph.erase_node(node)  # no change (`with torch.enable_grad()` in training)
                return _first_region(graph)
            for j in range(i + 1, len(nodes)):
                later = nodes[j]
                if later.op == "call_function" and later.target is _SET_GRAD:
                    if bool(later.args[0]) == ambient:
                        return nodes[i:j + 1], ("grad", bool(node.args[0]))
            raise CaptureError(grad_mode_left("the forward", bool(node.args[0])))
        if node.target is _ENTER:
            for j in range(i + 1, len(nodes)):
                later = nodes[j]
                if later.op == "call_function" and later.target is _EXIT and later.args[0] is node:
                    return nodes[i:j + 1], ("autocast", *node.args)
            raise CaptureError(
                "the forward enters torch.autocast without leaving it before it returns; use "
                "`with torch.autocast(...):` around the part that needs it"
            )
        if node.target is _EXIT:
            raise CaptureError("the forward leaves a torch.autocast region it did not enter")
    return None


def _outline(gm: torch.fx.GraphModule, span: list[torch.fx.Node], mode: tuple,
             index: int) -> None:
    graph = gm.graph
    start = span[0]
    # parameters and buffers become inputs, as in torch.export's regions: hoisted out of the span
    # (a buffer the region writes in place may be read after it: an EMA centre)
    for n in span[1:-1]:
        if n.op == "get_attr":
            start.prepend(n)
    span = [n for n in span if n.op != "get_attr"]
    body_nodes = span[1:-1]
    inside = set(span)
    inputs: list[torch.fx.Node] = []
    for n in body_nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [n for n in body_nodes if any(u not in inside for u in n.users)]

    body, env = subgraph(body_nodes, inputs)
    body.output(tuple(env[o] for o in outputs))
    kind = mode[0]
    name = _free_name(gm, f"{kind}_region_{index}")
    gm.add_submodule(name, torch.fx.GraphModule(gm, body, class_name=f"{kind.title()}Region"))

    wrapper, head = _wrapper(mode)
    with graph.inserting_before(start):
        sub = graph.get_attr(name)
        call = graph.call_function(wrapper, (*head, sub, *inputs))
        results = [graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    for old, new in zip(outputs, results):
        new.meta = dict(old.meta)
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in inside)
    for n in reversed(span):
        graph.erase_node(n)


def _wrapper(mode: tuple) -> tuple[Any, tuple]:
    hop = torch.ops.higher_order
    if mode[0] == "grad":
        return hop.wrap_with_set_grad_enabled, (mode[1],)
    return hop.wrap_with_autocast, tuple(mode[1:])


def _free_name(gm: torch.fx.GraphModule, name: str) -> str:
    candidate, i = name, 0
    while hasattr(gm, candidate):
        i += 1
        candidate = f"{name}_{i}"
    return candidate
