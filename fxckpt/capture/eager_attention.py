"""Eager attention: route a captured graph's masked attention through
:func:`fxckpt.runtime.attention.attention`, which calls the kernels eager code would have called.

Exported graphs call ``aten.scaled_dot_product_attention``; Dynamo's graphs (the default
training path) call ``torch.nn.functional.scaled_dot_product_attention`` and record Hugging
Face's ``repeat_kv`` as ``x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)``.
Both are rewritten alike. Traced, Hugging Face builds the mask eager code skips (it cannot look at
the positions or the padding mask while tracing), and the masked kernel reads it for every block:
on this CPU a Llama at sequence 2048 took 1.5x eager's step on the Dynamo path before this
rewrite, where the causal kernel skips the blocks above the diagonal.

For every scaled-dot-product attention given a boolean mask (and not ``is_causal``):

* the call becomes ``fxckpt_attention(q, k, v, mask, ...)``;
* Hugging Face's ``repeat_kv`` feeding its keys and values (``unsqueeze(x, 2)``, ``expand`` to
  ``n`` copies, ``reshape``) is folded into the call as ``kv_repeats=n``; the runtime repeats the
  heads itself when the mask stays. Only where the call was traced from a Hugging Face module's
  ``attention_interface(...)`` (its pluggable attention, whose sdpa implementation uses
  ``enable_gqa`` when run eagerly without a mask): the module class and the stack trace export
  records say so. Elsewhere eager code repeats the heads itself, and so does the graph;
* a mask computed from sizes alone (no input values, no parameters or buffers) that is causal
  or all visible at the example's sizes is not built at all: its ops move into a graph of their
  own (a submodule ``fxckpt_mask_<i>``), and ``fxckpt_sized_mask`` hands the calls the verdict
  (:func:`fxckpt.runtime.attention.sized_mask`). Sizes the capture did not see are looked at
  once each (a sliding window starts to cut past its width). So no step builds the mask, looks
  at it (a device sync on a GPU) or holds it from a segment's forward to its backward; and fake
  and meta runs, which have no values to look at, plan the kernels a real step runs.

    before:  k = reshape(expand(unsqueeze(k0, 2), [b, 2, 2, s, d]), [b, 4, s, d])
             mask = expand(and_(le(index(pos, ...), index(pos, ...)), ...), [b, 1, s, s])
             out = aten.scaled_dot_product_attention(q, k, v, mask, scale=0.17)
    after:   sized_mask = fxckpt_sized_mask(self.fxckpt_mask_0, b, s, at=(4, 128),
                                            kind='causal', lengths=(128, 128))
             out = fxckpt_attention(q, k0, v0, sized_mask, scale=0.17, kv_repeats=2)

A Hugging Face layer the graph calls as it is (sharded by FSDP, hooked) runs its own attention on
the ``attention_mask`` it is given, so its mask goes through
:func:`fxckpt.runtime.attention.layer_mask` first: ``None`` where eager code would have passed
``None`` (a causal mask to a causal layer), so the layer takes eager's kernel path.

    before:  layers_0 = self.layers.0(h, attention_mask=mask)
    after:   layer_mask = fxckpt_layer_mask(mask, causal=True)
             layers_0 = self.layers.0(h, attention_mask=layer_mask)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch
import torch.fx

from fxckpt import integrations
from fxckpt.runtime.attention import (MAX_MASK_ELEMENTS, attention, built_on_cpu, kind_of,
                                     layer_mask, size_hint, sized_mask)

__all__ = ["Rewritten", "eager_attention", "MAX_MASK_ELEMENTS"]

aten = torch.ops.aten
_SDPA = (aten.scaled_dot_product_attention.default, torch._C._nn.scaled_dot_product_attention)
"""The attention calls rewritten: export's aten op, and the function Dynamo's graphs call."""
_RANDOM = ("rand", "bernoulli", "dropout", "normal", "multinomial", "poisson", "exponential")
"""Names of calls that draw random numbers, for calls without aten's tags (Dynamo's graphs)."""


@dataclasses.dataclass(frozen=True)
class Rewritten:
    calls: int = 0
    """Attention calls now made through :func:`~fxckpt.runtime.attention.attention`."""
    repeats: int = 0
    """Of those, the calls whose ``repeat_kv`` was folded in (``kv_repeats``)."""
    expected: int = 0
    """Of those, the calls whose mask was found causal or all-visible at capture (``expect``)."""
    layers: int = 0
    """Hugging Face layers called as they are whose ``attention_mask`` goes through
    :func:`~fxckpt.runtime.attention.layer_mask`."""


def eager_attention(gm: torch.fx.GraphModule) -> Rewritten:
    """Rewrite ``gm``'s masked attention calls in place (see the module docstring)."""
    calls = repeats = expected = 0
    graph = gm.graph
    verdicts: dict[tuple, Optional[str]] = {}  # one mask node serves every layer: build it once
    sized: dict[tuple, torch.fx.Node] = {}
    for node in list(graph.nodes):
        mask = _boolean_mask(node)
        if mask is None:
            continue
        query, key, value = node.args[:3]
        kwargs = {k: v for k, v in node.kwargs.items() if k != "attn_mask"}
        folded = [integrations.repeated_kv(key), integrations.repeated_kv(value)]
        if (integrations.from_attention_interface(node) and folded[0] and folded[1]
                and folded[0][1] == folded[1][1]):
            key, value = folded[0][0], folded[1][0]
            kwargs["kv_repeats"] = folded[0][1]
            repeats += 1
        kind = _expected(mask, query, key, verdicts)
        given: Any = mask
        if kind is not None:
            given = _sized(gm, mask, kind, sized)
            expected += 1
        node.target = attention
        node.args = (query, key, value, given, *node.args[4:])
        node.kwargs = kwargs
        calls += 1
    layers = _layer_masks(gm)
    if calls:
        graph.eliminate_dead_code()  # the repeats folded in, the masks now built from sizes
    if calls or layers:
        graph.lint()
        gm.recompile()
    return Rewritten(calls, repeats, expected, layers)


def _layer_masks(gm: torch.fx.GraphModule) -> int:
    """Route the ``attention_mask`` of each Hugging Face layer called as it is through
    :func:`layer_mask` (module docstring); the number of layers."""
    done = 0
    for node in list(gm.graph.nodes):
        mask = node.kwargs.get("attention_mask") if node.op == "call_module" else None
        if not isinstance(mask, torch.fx.Node):
            continue
        value = _val(mask)  # often unknown: the swap's pytree plumbing carries no values
        causal = integrations.attention_causality(gm.get_submodule(str(node.target)))
        if causal is None or value is not None and not (
                isinstance(value, torch.Tensor) and value.dtype == torch.bool):
            continue
        with gm.graph.inserting_before(node):
            given = gm.graph.call_function(layer_mask, (mask,), {"causal": causal})
        if value is not None:
            given.meta["val"] = value
        node.kwargs = {**node.kwargs, "attention_mask": given}
        done += 1
    return done


def _boolean_mask(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The boolean ``attn_mask`` of a ``scaled_dot_product_attention`` call (not ``is_causal``);
    ``None`` for any other node."""
    if node.op != "call_function" or node.target not in _SDPA:
        return None
    mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
    causal = node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False)
    value = _val(mask)
    if causal is False and isinstance(value, torch.Tensor) and value.dtype == torch.bool:
        assert isinstance(mask, torch.fx.Node)
        return mask
    return None


def _expected(mask: torch.fx.Node, query: Any, key: Any,
              verdicts: dict[tuple, Optional[str]]) -> Optional[str]:
    """The mask's kind at the example's shapes, when shapes alone determine it (``verdicts``
    remembers it per mask node and query and key lengths)."""
    mask_val, q, k = _val(mask), _val(query), _val(key)
    if not all(isinstance(t, torch.Tensor) for t in (mask_val, q, k)):
        return None
    sizes = [size_hint(d) for d in mask_val.shape]
    queries, keys = size_hint(q.shape[-2]), size_hint(k.shape[-2])
    if None in sizes or queries is None or keys is None:
        return None
    if math.prod(sizes) > MAX_MASK_ELEMENTS:  # type: ignore[arg-type]
        return None
    seen = (mask, queries, keys)
    if seen not in verdicts:
        value = _evaluate(mask)
        usable = (isinstance(value, torch.Tensor) and value.dtype == torch.bool
                  and value.dim() >= 2 and tuple(value.shape[-2:]) == (queries, keys))
        verdicts[seen] = kind_of(value, queries, keys) if usable else None
    return verdicts[seen]


def _sized(gm: torch.fx.GraphModule, mask: torch.fx.Node, kind: str,
           made: dict[tuple, torch.fx.Node]) -> torch.fx.Node:
    """A ``sized_mask`` node standing for ``mask``, which sizes alone determine and which was
    ``kind`` at the example's sizes: the ops that build it move into a graph of their own (a
    submodule ``fxckpt_mask_<i>``), run only at sizes not seen before (one node per mask, where
    the mask was built)."""
    lengths = tuple(size_hint(d) for d in _val(mask).shape[-2:])
    seen = (mask, kind, lengths)
    if seen in made:
        return made[seen]
    built = _builder(mask)
    assert built is not None  # _expected found a kind: the mask was built from sizes
    builder, sizes = built
    name = f"fxckpt_mask_{len(made)}"
    while hasattr(gm, name):
        name += "_"
    gm.add_submodule(name, builder)
    at = tuple(size_hint(_val(n)) for n in sizes)
    with gm.graph.inserting_before(mask):  # where the mask was built, as part of what built it
        build = gm.graph.get_attr(name)
        made[seen] = gm.graph.call_function(
            sized_mask, (build, *sizes), {"at": at, "kind": kind, "lengths": lengths})
    for new in (build, made[seen]):  # the module it belongs to, for blocks and plan views
        new.meta.update({k: v for k, v in mask.meta.items() if k not in ("val", "example_value")})
    return made[seen]


def _builder(root: torch.fx.Node) -> Optional[tuple[torch.fx.GraphModule, list[torch.fx.Node]]]:
    """The ops ``root`` is computed from as a graph of their own, whose inputs are the sizes it
    reads (and those size nodes); ``None`` if it reads any value (an input's data, a parameter,
    a buffer) or draws random numbers. A size is ``aten.sym_size`` in an exported graph, a
    placeholder holding a symbolic int in Dynamo's."""
    needed: set[torch.fx.Node] = set()
    stack = [root]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        if _is_size(n):
            continue  # a size of an input, not its values
        if n.op not in ("call_function", "call_method") or _draws_random(n):
            return None  # reads values, or would change the RNG state capture must leave alone
        stack.extend(n.all_input_nodes)
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    sizes: list[torch.fx.Node] = []
    for n in root.graph.nodes:
        if n not in needed:
            continue
        if _is_size(n):
            sizes.append(n)
            env[n] = graph.placeholder(n.name)
        else:
            env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(env[root])
    return torch.fx.GraphModule(torch.nn.Module(), graph, "SizedMask"), sizes


def _evaluate(root: torch.fx.Node) -> Any:
    """``root`` computed on the CPU from the example's sizes, or ``None`` if it reads any value
    (:func:`_builder`), a size has no example value, or it fails."""
    built = _builder(root)
    if built is None:
        return None
    builder, sizes = built
    hints = [size_hint(_val(n)) for n in sizes]
    if None in hints:
        return None
    try:
        return built_on_cpu(builder, tuple(h for h in hints if h is not None))
    except Exception:  # noqa: BLE001 - an op that needs more than sizes: no verdict
        return None


def _is_size(node: torch.fx.Node) -> bool:
    if node.op == "call_function":
        return node.target is aten.sym_size.int
    return node.op == "placeholder" and isinstance(_val(node), torch.SymInt)


def _draws_random(node: torch.fx.Node) -> bool:
    tags = getattr(node.target, "tags", None)
    if tags is not None:
        return torch.Tag.nondeterministic_seeded in tags
    name = str(node.target) if node.op == "call_method" else getattr(node.target, "__name__", "")
    return any(word in name for word in _RANDOM)


def _val(node: Any) -> Any:
    """The example value a captured node carries: ``val`` (export), ``example_value`` (Dynamo)."""
    if not isinstance(node, torch.fx.Node):
        return None
    value = node.meta.get("val")
    return node.meta.get("example_value") if value is None else value
