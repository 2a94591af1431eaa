"""Capture: turn an ``nn.Module`` into a ``torch.fx.GraphModule``.

``torch.fx.symbolic_trace`` comes first: it keeps leaf modules as ``call_module`` nodes, so module
paths and the generated code stay readable, and it runs nothing. Non-tensor arguments seen at the
call (``mask=None``, ``return_dict=False``) are passed as ``concrete_args`` so Python branches on
them resolve. When symbolic tracing fails (data-dependent Python, Hugging Face models) and inputs
are known, ``torch.export`` (non-strict, training IR) captures the graph instead; its
``module()`` replays the eager model exactly and shares the model's Parameters. A graph is
captured per training mode, because both methods bake ``self.training`` into the graph.

    model --symbolic_trace--> GraphModule            (no inputs needed)
          `-export(args)----> GraphModule (aten)     (fallback, needs inputs)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Iterator, Optional

import torch
import torch.fx
import torch.utils._pytree as pytree

from fxckpt.errors import CaptureError
from fxckpt.signature import bind_positional, is_static_value

__all__ = ["Captured", "capture"]

log = logging.getLogger(__name__)

SYMBOLIC = "symbolic_trace"
EXPORT = "export"


@dataclasses.dataclass
class Captured:
    """A captured graph and how to feed it the model's call arguments."""

    gm: torch.fx.GraphModule
    method: str
    """``symbolic_trace`` (placeholders are the forward's parameters) or ``export`` (pytree leaves)."""
    forward: Any
    """The model's bound ``forward``, used to bind calls for symbolic graphs."""

    def graph_args(self, args: tuple, kwargs: dict) -> list:
        """The values of the graph's placeholders, in order, for a call ``model(*args, **kwargs)``."""
        if self.method == SYMBOLIC:
            return list(bind_positional(self.forward, args, kwargs).arguments.values())
        return pytree.tree_leaves((args, kwargs))

    def call(self, gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> Any:
        """Run ``gm`` (this graph, or a rewrite of it) as the model would run on these inputs."""
        if self.method == SYMBOLIC:
            return gm(*bind_positional(self.forward, args, kwargs).arguments.values())
        return gm(*args, **kwargs)


def capture(
    model: torch.nn.Module, args: Optional[tuple] = None, kwargs: Optional[dict] = None
) -> Captured:
    """Capture ``model`` as a GraphModule; see the module docstring for the order of methods."""
    failures: list[tuple[str, BaseException]] = []
    try:
        concrete = _concrete_args(model, args, kwargs)
        gm = torch.fx.symbolic_trace(model, concrete_args=concrete)
        log.debug("captured %s with symbolic_trace (%d nodes)", type(model).__name__, len(gm.graph.nodes))
        return Captured(gm, SYMBOLIC, model.forward)
    except Exception as e:  # any tracer failure: fall back and report it if export fails too
        failures.append((SYMBOLIC, e))
    if args is None and kwargs is None:
        raise CaptureError(_message(model, failures, have_inputs=False)) from failures[0][1]
    try:
        with _preserved_state(model):
            ep = torch.export.export(model, tuple(args or ()), dict(kwargs or {}), strict=False)
        gm = ep.module()
        log.info("captured %s with torch.export (symbolic_trace failed: %s)", type(model).__name__,
                 _first_line(failures[0][1]))
        return Captured(gm, EXPORT, model.forward)
    except Exception as e:
        failures.append((EXPORT, e))
        raise CaptureError(_message(model, failures, have_inputs=True)) from e


def _concrete_args(model: torch.nn.Module, args: Optional[tuple], kwargs: Optional[dict]) -> Optional[dict]:
    """Arguments holding no tensor, by name, so the tracer resolves branches on them."""
    if args is None and kwargs is None:
        return None
    bound = bind_positional(model.forward, tuple(args or ()), dict(kwargs or {}))
    return {k: v for k, v in bound.arguments.items() if is_static_value(v)} or None


@contextlib.contextmanager
def _preserved_state(model: torch.nn.Module) -> Iterator[None]:
    """Capture must not change what the next real step computes: keep RNG and buffers as they were."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            torch.clear_autocast_cache()  # export's fake casts must not reach the real step
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _message(model: torch.nn.Module, failures: list, have_inputs: bool) -> str:
    name = type(model).__name__
    lines = [f"fxckpt could not capture {name} as a torch.fx graph."]
    for method, err in failures:
        lines.append(f"  - {method} failed with {_first_line(err)}")
    lines.append("How to fix it:")
    if not have_inputs:
        lines.append(
            "  - pass example inputs (fxckpt.transform(model, ..., example_inputs=(x,)) or call the "
            "transformed module) so torch.export can capture what symbolic tracing cannot;"
        )
    lines += [
        "  - give the tracer fixed values for Python-level arguments (concrete_args): non-tensor "
        "arguments at the call are already treated so;",
        "  - keep data-dependent Python (`if x.sum() > 0`) inside a leaf module or a function "
        "registered with torch.fx.wrap, or rewrite it with torch.where / torch.cond;",
        "  - see docs/guide.md, 'When a model does not trace'.",
    ]
    return "\n".join(lines)
