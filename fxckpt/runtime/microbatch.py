"""Micro-batches: split a call's inputs along the batch dimension, and gather the outputs back.

A pipeline keeps its stages busy by feeding them pieces of the batch one after another, so the
inputs of one call become ``chunks`` calls and their outputs become one again:

    x [8, ...]  --scatter(chunks=3)-->  x0 [3, ...]  x1 [3, ...]  x2 [2, ...]
    y0, y1, y2  --gather-->             y [8, ...]      (torch.cat on dim 0; structure kept)

Rules (torchgpipe's, with ``torch.tensor_split`` sizes):

* every tensor with at least one dimension is split along dim 0, and all of them must have the
  same size there -- otherwise a ``ValueError`` names the arguments and their sizes;
* a batch smaller than ``chunks`` gives fewer, non-empty pieces; an uneven batch gives uneven
  pieces (8 into 3: 3, 3, 2);
* non-tensor arguments and 0-dim tensors go to every micro-batch unchanged;
* outputs keep their structure (tuple, list, dict, namedtuple, dataclass, Hugging Face
  ``ModelOutput``); tensors are concatenated on dim 0; any other value must be the same in every
  micro-batch (``None``, a flag, a name), or a ``ValueError`` names it -- a value computed from
  the batch size (``x.shape[0]``) is refused when the pipeline is built
  (:mod:`fxckpt.pipeline.batch_outputs`), since equal micro-batches would hide it.

The pieces are views, so gradients flow back into the caller's tensors as if nothing was split.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch
import torch.utils._pytree as pytree

from fxckpt.checks import check_int
from fxckpt import integrations

__all__ = ["scatter", "gather", "batch_size", "same_value"]

MicroBatch = tuple[tuple, dict]


def _name(path: tuple, names: Optional[Sequence[str]]) -> str:
    """``((SequenceKey(0), SequenceKey(1)), names)`` -> ``names[1]`` or ``args[1]``."""
    if not path:
        return "input"
    head, rest = path[0], path[1:]
    if getattr(head, "idx", None) == 0 and rest:  # positional arguments
        i = getattr(rest[0], "idx", None)
        base = (
            names[i]
            if names is not None and isinstance(i, int) and i < len(names)
            else f"args[{i}]"
        )
        return base + pytree.keystr(tuple(rest[1:]))
    if rest and hasattr(rest[0], "key"):
        return str(rest[0].key) + pytree.keystr(tuple(rest[1:]))
    return pytree.keystr(tuple(path))


def batch_size(args: tuple, kwargs: dict, names: Optional[Sequence[str]] = None) -> Optional[int]:
    """The common dim-0 size of every tensor input (``None`` if no input has a dimension)."""
    leaves, _ = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    sizes = [
        (_name(path, names), t.shape[0])
        for path, t in leaves
        if isinstance(t, torch.Tensor) and t.dim() > 0
    ]
    if not sizes:
        return None
    if len({s for _, s in sizes}) > 1:
        shown = ", ".join(f"{n}: {s}" for n, s in sizes)
        raise ValueError(
            "every tensor input must have the same batch size along dim 0 to be split into "
            f"micro-batches (got {shown}); pass per-sample tensors only, or non-batch data as "
            "non-tensors"
        )
    return int(sizes[0][1])


def scatter(
    args: tuple, kwargs: dict, chunks: int, names: Optional[Sequence[str]] = None
) -> list[MicroBatch]:
    """Split ``(args, kwargs)`` into at most ``chunks`` micro-batches along dim 0."""
    check_int("chunks", chunks)
    batch = batch_size(args, kwargs, names)
    pieces = 1 if not batch else min(chunks, batch)
    if pieces == 1:
        return [(tuple(args), dict(kwargs))]
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    split = [
        torch.tensor_split(t, pieces, dim=0)
        if isinstance(t, torch.Tensor) and t.dim() > 0
        else None
        for t in leaves
    ]
    out = []
    for i in range(pieces):
        mb = [s[i] if s is not None else leaf for s, leaf in zip(split, leaves)]
        out.append(pytree.tree_unflatten(mb, spec))
    return out


def gather(outputs: Sequence[Any]) -> Any:
    """Join the outputs of the micro-batches, in order, into the output of the whole batch."""
    if not outputs:
        raise ValueError("gather needs the output of at least one micro-batch (got none)")
    if len(outputs) == 1:
        return outputs[0]
    return _gather(list(outputs), "output")


def _gather(items: list, where: str) -> Any:
    first = items[0]
    if isinstance(first, torch.Tensor):
        return _cat(items, where)
    _same_kind(items, where)
    if integrations.is_output(first) or isinstance(first, dict):
        values = {k: _gather([it[k] for it in items], f"{where}[{k!r}]") for k in first.keys()}
        return _rebuild_mapping(first, values)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        fields = [f.name for f in dataclasses.fields(first)]
        values = {f: _gather([getattr(it, f) for it in items], f"{where}.{f}") for f in fields}
        return dataclasses.replace(
            first, **{f.name: values[f.name] for f in dataclasses.fields(first) if f.init}
        )
    if isinstance(first, (tuple, list)):
        parts = [_gather([it[i] for it in items], f"{where}[{i}]") for i in range(len(first))]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)(*parts)
        return type(first)(parts)
    return _one_value(items, where)


def _one_value(items: list, where: str) -> Any:
    """A non-tensor output is the whole batch's only if every micro-batch returned the same."""
    for i, it in enumerate(items[1:], start=1):
        if not same_value(it, items[0]):
            raise ValueError(
                f"{where} is {_show(items[0])} in micro-batch 0 but {_show(it)} in micro-batch "
                f"{i}; a non-tensor output must be the same in every micro-batch to be the "
                "batch's. Return it as a tensor with a batch dimension, or compute it outside the "
                "pipeline"
            )
    return items[0]


def same_value(a: Any, b: Any) -> bool:
    """``a == b`` as one bool; ``False`` when ``==`` gives no single answer (arrays) or fails."""
    try:
        return a is b or bool(a == b)
    except Exception:  # e.g. an array's elementwise ==
        return False


def _show(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def _cat(items: list, where: str) -> torch.Tensor:
    bad = [i for i, t in enumerate(items) if not isinstance(t, torch.Tensor) or t.dim() == 0]
    if bad:
        raise ValueError(
            f"{where} of micro-batch {bad[0]} is {_describe(items[bad[0]])}; outputs are joined "
            "by concatenating tensors along dim 0, so return per-sample tensors (compute a "
            "reduced loss outside the pipeline)"
        )
    return torch.cat(items, dim=0)


def _same_kind(items: list, where: str) -> None:
    first = items[0]
    for i, it in enumerate(items[1:], start=1):
        if type(it) is not type(first):
            raise ValueError(
                f"{where} is a {type(first).__name__} in micro-batch 0 but a "
                f"{type(it).__name__} in micro-batch {i}; every micro-batch must return the same "
                "structure"
            )
        if isinstance(first, dict) or integrations.is_output(first):
            if list(it.keys()) != list(first.keys()):
                raise ValueError(f"{where} has keys {list(first.keys())} in micro-batch 0 but "
                                 f"{list(it.keys())} in micro-batch {i}")
        elif isinstance(first, (tuple, list)) and len(it) != len(first):
            raise ValueError(
                f"{where} has {len(first)} items in micro-batch 0 but {len(it)} in micro-batch {i}"
            )


def _rebuild_mapping(first: Any, values: dict) -> Any:
    if integrations.is_output(first):
        return type(first)(**values)
    out = first.copy()  # keeps the mapping type (OrderedDict, defaultdict's factory, ...)
    out.update(values)
    return out


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a 0-dim tensor ({x.dtype})"
    return f"a {type(x).__name__}"
