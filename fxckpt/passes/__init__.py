"""Compiler passes over ``torch.fx`` graphs: capture, annotate, select strategies, lower.

Each pass takes a GraphModule (or the model, for capture) and returns a result. Analysis passes
only add ``node.meta[META_KEY]``; the lowering pass rewrites the graph and ends with
``graph.lint()`` and ``recompile()``.
"""

from fxckpt.passes.annotate import META_KEY, NodeInfo, annotate
from fxckpt.passes.capture import Captured, capture
from fxckpt.passes.lower import lower
from fxckpt.passes.select import select

__all__ = ["META_KEY", "NodeInfo", "annotate", "Captured", "capture", "lower", "select"]
