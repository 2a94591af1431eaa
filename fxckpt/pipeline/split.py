"""Split: one GraphModule per pipeline stage, from a stage assignment.

:func:`split_stages` turns a stage assignment (``StagePlan.stage_of``,
:mod:`fxckpt.pipeline.partition`) into one GraphModule per stage. Stage ``j`` takes every value
made before it and used at or after it, and returns every value made at or before it and used
after it, so values that skip stages are passed through automatically:

    stage 0               stage 1                 stage 2
    x --> a --> b ------> c = f(b) ------------>  d = g(c)
          `-- a -------------------- a (carried) --> cat(d, a)     # a U-Net skip

Parameters and buffers are read with ``get_attr`` inside each stage that uses them; the stage
GraphModules hold the same Parameter objects as the graph they came from. The verdict on an
attention mask made from sizes (``fxckpt_sized_mask``, :func:`fxckpt.runtime.attention.sized_mask`:
a tuple, which ``torch.distributed.pipelining`` cannot send) is made again in each stage that
uses it, from the sizes that stage has. Exported graphs
(pytree calling convention) become stages with flat inputs and a flat output;
:func:`pytree_specs` gives the specs to rebuild the caller's structure.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

import torch
import torch.fx

from fxckpt.errors import ConfigError, PlanError
from fxckpt.capture.graphs import COMPUTE_OPS, copy_nodes
from fxckpt.runtime.attention import sized_mask

__all__ = ["split_stages", "pytree_specs"]

log = logging.getLogger(__name__)


def pytree_specs(gm: torch.fx.GraphModule) -> Optional[tuple[Any, Any]]:
    """``(in_spec, out_spec)`` of an exported graph's calling convention, or ``None``."""
    info_ = getattr(gm.graph._codegen, "pytree_info", None)
    return None if info_ is None else (info_.in_spec, info_.out_spec)


def split_stages(
    gm: torch.fx.GraphModule, stage_of: Mapping[str, int]
) -> list[torch.fx.GraphModule]:
    """One GraphModule per stage; see the module docstring for what each takes and returns."""
    nodes = list(gm.graph.nodes)
    stage = _check_stage_of(nodes, stage_of)
    k = max(stage.values()) + 1
    carried = _carried(nodes, stage, k)
    sizes = [_sizes_read_off(c) for c in carried]
    carried = [[v for v in c if v not in read] for c, read in zip(carried, sizes)]
    out = []
    for j in range(k):
        try:
            out.append(_build_stage(gm, nodes, stage, j, k, carried, sizes[j - 1] if j else {}))
        except Exception as e:
            raise PlanError(f"split_stages: could not build stage {j} of {k}: {e}") from e
    log.debug(
        "split into %d stages; carried between stages: %s",
        k,
        [[n.name for n in c] for c in carried],
    )
    return out


def _check_stage_of(
    nodes: list[torch.fx.Node], stage_of: Mapping[str, int]
) -> dict[torch.fx.Node, int]:
    compute = [n for n in nodes if n.op in COMPUTE_OPS]
    missing = [n.name for n in compute if n.name not in stage_of]
    if missing:
        raise ConfigError(
            f"stage_of must give a stage for every compute node (missing {missing[:5]})"
        )
    stage = {n: stage_of[n.name] for n in compute}
    values = [stage[n] for n in compute]
    if (
        not values
        or values[0] != 0
        or any(b - a not in (0, 1) for a, b in zip(values, values[1:]))
    ):
        raise ConfigError(
            "stages must be contiguous: stage numbers start at 0 and never decrease or skip along "
            f"the topological order (got {values})"
        )
    return stage


def _carried(
    nodes: list[torch.fx.Node], stage: dict[torch.fx.Node, int], k: int
) -> list[list[torch.fx.Node]]:
    """``carried[j]``: values made at or before stage j and used after it (boundary j -> j+1).
    A value made again in each stage (:func:`_made_again`) is not carried, its inputs are."""
    carried: list[list[torch.fx.Node]] = [[] for _ in range(k - 1)]
    for n in nodes:
        if n.op in ("get_attr", "output") or _made_again(n):
            continue
        made = stage.get(n, 0)  # placeholders are stage 0's inputs
        last = max((_last_use(u, stage, k) for u in n.users), default=made)
        for j in range(made, last):
            carried[j].append(n)
    return carried


def _made_again(node: torch.fx.Node) -> bool:
    """A value each stage that uses it makes for itself: a mask's verdict from sizes."""
    return node.op == "call_function" and node.target is sized_mask


def _last_use(user: torch.fx.Node, stage: dict[torch.fx.Node, int], k: int) -> int:
    """The last stage that needs ``user``'s inputs: its own (the output is built last), or, for
    a value made again in each stage, the last of its users'."""
    if _made_again(user):
        return max((_last_use(u, stage, k) for u in user.users), default=stage.get(user, 0))
    return stage.get(user, k - 1)


def _sizes_read_off(values: list[torch.fx.Node]) -> dict[torch.fx.Node, tuple[torch.fx.Node, int]]:
    """Symbolic sizes among ``values`` that one of the tensors among them has as a dimension.

    An exported graph with dynamic shapes computes ``sym_size`` ints early and uses them late
    (``view(batch, seq, -1)``). Carried across a stage boundary they would be values that are
    not tensors, which ``torch.distributed.pipelining`` cannot send; the next stage reads them
    off a tensor it receives anyway (``node.meta["val"]`` says which dimension is which symbol).
    """
    dims: dict[Any, tuple[torch.fx.Node, int]] = {}
    for t in values:
        val = t.meta.get("val")
        if isinstance(val, torch.Tensor):
            for d, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt):
                    dims.setdefault(size.node.expr, (t, d))
    read = {}
    for v in values:
        val = v.meta.get("val")
        if isinstance(val, torch.SymInt) and val.node.expr in dims:
            read[v] = dims[val.node.expr]
    return read


def _build_stage(
    gm: torch.fx.GraphModule,
    nodes: list[torch.fx.Node],
    stage: dict[torch.fx.Node, int],
    j: int,
    k: int,
    carried: list[list[torch.fx.Node]],
    sizes: Mapping[torch.fx.Node, tuple[torch.fx.Node, int]],
) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    if j == 0:
        for p in (n for n in nodes if n.op == "placeholder"):
            env[p] = graph.node_copy(p)
    else:
        for v in carried[j - 1]:
            env[v] = graph.placeholder(v.name)
            env[v].meta = dict(v.meta)
        for v, (t, d) in sizes.items():
            env[v] = graph.call_function(torch.ops.aten.sym_size.int, (env[t], d))
            env[v].meta = dict(v.meta)
    last = [next(n for n in reversed(nodes) if n.op == "output")] if j == k - 1 else []
    again = [n for n in nodes if _made_again(n) and stage.get(n, 0) < j
             and any(stage.get(u, k - 1) == j for u in n.users)]
    copy_nodes(graph, again + [n for n in nodes if stage.get(n) == j] + last, env)
    if j < k - 1:
        graph.output(tuple(env[v] for v in carried[j]))
    graph.lint()
    sgm = torch.fx.GraphModule(gm, graph, class_name=f"Stage{j}")
    sgm.meta["fxckpt_stage"] = {"index": j, "stages": k,
                                "inputs": [n.name for n in graph.nodes if n.op == "placeholder"],
                                "outputs": [v.name for v in carried[j]] if j < k - 1 else None}
    return sgm
