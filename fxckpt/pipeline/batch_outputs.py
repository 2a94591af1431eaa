"""Which non-tensor outputs of a graph follow the batch size (``x.shape[0]``, ``len(x)``).

A pipeline joins its micro-batches' outputs: tensors are concatenated, and any other value must
be the same in every micro-batch (:func:`fxckpt.runtime.microbatch.gather`). A value computed
from the batch size passes that check whenever the micro-batches are equal -- and is then the
micro-batch's value (2 for a batch of 4 in 2 chunks), not the model's. The only way to know is
to ask the graph: run it on fake tensors (no compute) at the annotated batch size ``b`` and at
``b + 1``; a non-tensor output that changes depends on the batch size.

    output = {"logits": t, "n": x.shape[0]}      run at b: n = b     run at b + 1: n = b + 1
                                                 -> ["output['n']"]
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.fx
import torch.utils._pytree as pytree

from fxckpt.cost.annotate import faking, has_info, info
from fxckpt.capture.traceless import hooks_off
from fxckpt.signature import has_hooks
from fxckpt.runtime.microbatch import same_value

__all__ = ["batch_outputs"]

log = logging.getLogger(__name__)


def batch_outputs(gm: torch.fx.GraphModule) -> list[str]:
    """Names of the annotated ``gm``'s non-tensor outputs whose value changes with the batch."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    leaves = [n for n in pytree.tree_leaves(output.args[0]) if isinstance(n, torch.fx.Node)]
    suspects = [n for n in leaves if has_info(n) and not info(n).is_tensor]
    batch = _batch(gm)
    if not suspects or batch is None:
        return []
    try:
        first, second = (_values(gm, suspects, b) for b in (batch, batch + 1))
    except Exception as e:  # the graph takes one batch size only: nothing to compare
        log.debug("batch_outputs: the graph does not run at batch %d (%s)", batch + 1, e)
        return []
    names = _leaf_names(gm, output)
    return [names[n] for n, a, b in zip(suspects, first, second) if not same_value(a, b)]


def _batch(gm: torch.fx.GraphModule) -> Optional[int]:
    inputs = [info(n) for n in gm.graph.nodes if n.op == "placeholder" and has_info(n)]
    sizes = {i.shapes[0][0] for i in inputs if i.shapes and i.shapes[0]}
    return sizes.pop() if len(sizes) == 1 else None


def _values(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], batch: int) -> list[Any]:
    """The values of ``nodes`` when ``gm`` runs on fake inputs with this batch size."""
    hooked = [m for m in gm.modules() if has_hooks(m)]  # a user's hooks must not see fake tensors
    with hooks_off(hooked), faking(gm), torch.no_grad():
        args = [_fake_input(n, batch) for n in gm.graph.nodes if n.op == "placeholder"]
        run = torch.fx.Interpreter(gm, garbage_collect_values=False)
        run.run(*args)
        return [run.env[n] for n in nodes]


def _fake_input(n: torch.fx.Node, batch: int) -> Any:
    if not has_info(n) or not info(n).is_tensor:
        return n.args[0] if n.args else None  # a traced default (concrete_args), or None
    node = info(n)
    shape = (batch, *node.shapes[0][1:]) if node.shapes[0] else ()
    dtype = getattr(torch, node.dtypes[0])
    return torch.zeros(shape, dtype=dtype, device=node.device)  # under the fake mode: no memory


def _leaf_names(gm: torch.fx.GraphModule, output: torch.fx.Node) -> dict[torch.fx.Node, str]:
    """``output['n']``: each output node's place in what the model returns."""
    tree: Any = output.args[0]
    spec = getattr(gm.graph._codegen, "pytree_info", None)
    if spec is not None and spec.out_spec is not None:  # exported: flat outputs, the caller's spec
        tree = pytree.tree_unflatten(list(pytree.tree_leaves(tree)), spec.out_spec)
    paths, _ = pytree.tree_flatten_with_path(tree)
    return {leaf: "output" + pytree.keystr(path) for path, leaf in paths
            if isinstance(leaf, torch.fx.Node)}
