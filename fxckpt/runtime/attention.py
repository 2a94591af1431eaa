"""Attention as eager code would have run it.

Run eagerly, a Hugging Face model without padding calls ``scaled_dot_product_attention`` with
``is_causal=True`` (decoders) or no mask at all (encoders), and with ``enable_gqa=True`` where
there are fewer key/value heads than heads. Traced by ``torch.export`` it cannot take those
branches (they depend on whether the mask is ``None``), so the exported graph builds a boolean
mask (``[batch, 1, L, S]``), repeats the key/value heads (``repeat_kv``) and passes both: the
kernel then converts the mask to floats and reads it for every block, where the causal kernel
skips the blocks above the diagonal, and the gradients of grouped heads are summed in another
order than eager's.

:func:`attention` is what an exported graph calls instead of the aten op (``fxckpt_attention`` in
``tm.code``; :mod:`fxckpt.capture.simplify` rewrites the calls). It looks at the mask's values
once per mask tensor and calls the aten op as eager code would have:

* a mask equal to ``ones(L, S).tril()`` on every batch and head: ``is_causal=True``, no mask;
* a mask that is all ``True``: no mask;
* anything else (padding, a float mask, under ``torch.compile``): the mask as given;
* ``kv_repeats=n`` (the graph's ``repeat_kv`` folded into the call): without a mask,
  ``enable_gqa=True`` on the unrepeated heads (as Hugging Face's eager attention does when the
  head size is at most 256), else the heads repeated here, by the ops the graph had.

A mask that depends on sizes only reaches the call as a verdict, ``(kind, queries, keys)``,
from :func:`sized_mask`, which builds and looks at such a mask only at sizes the capture did not
see. Fake and meta tensors (planning, verification) have no values to look at: a mask tensor
given with ``expect`` (graphs saved before :func:`sized_mask`) follows that verdict.

A causal or all-visible boolean mask and its shortcut give bit-identical outputs and gradients
(tested), so dropping the mask changes speed only; ``enable_gqa`` is what eager runs.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator, Optional

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from fxckpt import integrations

__all__ = ["attention", "layer_mask", "sized_mask", "built_on_cpu", "size_hint", "mask_kind",
           "kind_of", "planning", "CAUSAL", "FULL", "MAX_MASK_ELEMENTS"]

_sdpa = torch.ops.aten.scaled_dot_product_attention.default
_local = threading.local()
CAUSAL, FULL = "causal", "full"
MAX_MASK_ELEMENTS = 1 << 24
"""Masks larger than this (16 M elements; the int64 positions that build them take 8 bytes
each) are not built on the CPU to find a verdict for a run without values: planning then assumes
the mask stays, which over-states memory (a float copy of the mask per layer), never under-states
it."""
_KINDS_KEPT = 64
"""Verdicts :func:`sized_mask` remembers per mask, one per distinct set of sizes."""


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
              is_causal: bool = False, *, scale: Optional[float] = None,
              enable_gqa: bool = False, kv_repeats: int = 1,
              expect: Optional[str] = None) -> torch.Tensor:
    """``aten.scaled_dot_product_attention`` as eager code would call it (module docstring)."""
    if isinstance(attn_mask, tuple):  # a verdict from :func:`sized_mask`: no mask tensor at all
        is_causal, attn_mask = _verdict(attn_mask, query, key) == CAUSAL, None
    elif attn_mask is not None and not is_causal:
        kind = expect if _valueless(attn_mask) else mask_kind(
            attn_mask, query.shape[-2], key.shape[-2])
        if kind == CAUSAL:
            attn_mask, is_causal = None, True
        elif kind == FULL:
            attn_mask = None
    if kv_repeats > 1:
        limit = integrations.gqa_head_limit()  # Hugging Face's eager attention: 256
        if attn_mask is None and key.shape[-1] == value.shape[-1] <= limit:
            enable_gqa = True
        else:
            key, value = _repeat(key, kv_repeats), _repeat(value, kv_repeats)
    return _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                 enable_gqa=enable_gqa)


attention.__module__ = "fxckpt"  # generated code reads `fxckpt_attention(...)`


def layer_mask(mask: Any, causal: bool) -> Any:
    """The ``attention_mask`` a Hugging Face layer called as it is (sharded by FSDP, hooked)
    gets, as eager code would have given it: ``None`` where the boolean mask an exported graph
    built is one eager code skips (causal, for a layer whose attention is causal; all visible, for
    a non-causal one or a single query), so the layer's own attention takes the same kernel path
    (``is_causal=True`` or no mask) as eager; else the mask as it is. Fake and meta masks stay."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or _valueless(mask):
        return mask
    kind = mask_kind(mask, mask.shape[-2], mask.shape[-1])
    if kind == CAUSAL and causal or kind == FULL and (not causal or mask.shape[-2] == 1):
        return None
    return mask


layer_mask.__module__ = "fxckpt"  # generated code reads `fxckpt_layer_mask(...)`


def sized_mask(build: torch.fx.GraphModule, *sizes: Any, at: tuple[int, ...], kind: str,
               lengths: tuple[int, int]) -> Any:
    """The mask of attention calls whose mask the sizes alone determine, as the calls need it:
    ``(kind, queries, keys)`` where the mask ``build(*sizes)`` makes is causal or all visible
    (``kind``: :data:`CAUSAL`, :data:`FULL`), so that no mask tensor is built, looked at or held
    by a checkpointed segment; else the mask itself.

    ``at`` are the sizes the mask was looked at when the graph was captured, ``kind`` what it was
    there and ``lengths`` its last two sizes: those sizes need nothing built. Other sizes (a
    longer sequence, where a sliding window starts to cut) are looked at once each, on the CPU,
    and the verdict remembered on ``build``; a mask that is neither causal nor all visible there
    is built on every call, as the captured graph did (``sized_mask`` in ``tm.code``;
    :mod:`fxckpt.capture.eager_attention` puts it in the graph)."""
    if torch.compiler.is_compiling() and not _PLANNING[0]:
        return build(*sizes)  # torch.compile keeps masks, as :func:`mask_kind` says
    hints = [size_hint(s) for s in sizes]
    if None in hints or tuple(hints) == tuple(at):  # None: a plan's symbolic sizes
        return (kind, *lengths)
    hinted = tuple(h for h in hints if h is not None)
    kinds: dict[tuple, Any] = build.__dict__.setdefault("_fxckpt_kinds", {})
    if hinted not in kinds:
        if len(kinds) >= _KINDS_KEPT:
            kinds.clear()
        kinds[hinted] = _look(build, hinted)
    verdict = kinds[hinted]
    return build(*sizes) if verdict is None else verdict


sized_mask.__module__ = "fxckpt"  # generated code reads `fxckpt_sized_mask(...)`


def _look(build: torch.fx.GraphModule, sizes: tuple[int, ...]) -> Any:
    """The verdict for the mask ``build`` makes at ``sizes``, looked at on the CPU (out of any
    fake mode: a plan's sizes are real), or ``None`` for a mask to keep."""
    with _disable_current_modes():
        try:
            mask = built_on_cpu(build, sizes)
        except Exception:  # noqa: BLE001 - a mask that cannot be built here is kept
            return None
        if not isinstance(mask, torch.Tensor) or mask.dtype is not torch.bool or mask.dim() < 2:
            return None
        queries, keys = mask.shape[-2:]
        found = kind_of(mask, queries, keys)
    return None if found is None else (found, queries, keys)


def built_on_cpu(build: torch.fx.GraphModule, sizes: tuple[int, ...]) -> Any:
    """``build(*sizes)`` with every ``device=`` it names moved to the CPU; ``ValueError`` for a
    tensor of more than :data:`MAX_MASK_ELEMENTS` on the way (capture builds masks with it to
    find their verdict, :func:`sized_mask` at sizes the capture did not see)."""
    env: dict[torch.fx.Node, Any] = {}
    given = iter(sizes)
    for n in build.graph.nodes:
        if n.op == "placeholder":
            env[n] = next(given)
        elif n.op == "output":
            return torch.fx.node.map_arg(n.args[0], env.__getitem__)
        else:
            args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
            if "device" in kwargs:
                kwargs = dict(kwargs, device=torch.device("cpu"))
            if n.op == "call_method":
                env[n] = getattr(args[0], str(n.target))(*args[1:], **kwargs)
            else:
                env[n] = n.target(*args, **kwargs)
            if isinstance(env[n], torch.Tensor) and env[n].numel() > MAX_MASK_ELEMENTS:
                raise ValueError("too large to build for a verdict")
    return None


def _verdict(verdict: tuple, query: torch.Tensor, key: torch.Tensor) -> str:
    """The kind of a :func:`sized_mask` verdict, whose lengths must be the call's."""
    kind, queries, keys = verdict
    if (queries, keys) != (query.shape[-2], key.shape[-2]):
        raise RuntimeError(
            f"fxckpt: an attention mask computed from sizes was {kind} over {queries} x {keys} "
            f"positions, but the call attends {query.shape[-2]} queries to {key.shape[-2]} keys")
    return str(kind)


def size_hint(size: Any) -> Optional[int]:
    """The value of a size: an int, or a symbolic one's example value (``int(SymInt)`` would add
    a guard to export's shapes); ``None`` where there is none."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if hint is not None else None
    return int(size) if isinstance(size, int) else None


_PLANNING = [False]
"""Whether fxckpt is planning a graph inside its Dynamo backend (:func:`planning`): a plain
global, which code Dynamo traces can read without a graph break (a ``ContextVar`` cannot)."""


@contextlib.contextmanager
def planning() -> Iterator[None]:
    """Fake runs in here are fxckpt's own (planning a graph Dynamo handed its backend): they
    follow ``expect`` although Dynamo is compiling."""
    before, _PLANNING[0] = _PLANNING[0], True
    try:
        yield
    finally:
        _PLANNING[0] = before


def _valueless(mask: torch.Tensor) -> bool:
    """Fake or meta: shapes only (not under ``torch.compile``, whose tensors are real, unless the
    run is fxckpt's own planning inside its Dynamo backend)."""
    return (isinstance(mask, FakeTensor) or mask.device.type == "meta") and (
        not torch.compiler.is_compiling() or _PLANNING[0])


def _repeat(x: torch.Tensor, n: int) -> torch.Tensor:
    """``repeat_kv``: ``[b, h, s, d]`` -> ``[b, h * n, s, d]``, each head ``n`` times in a row."""
    b, h, s, d = x.shape
    return x.unsqueeze(2).expand(b, h, n, s, d).reshape(b, h * n, s, d)


def mask_kind(mask: torch.Tensor, queries: Any, keys: Any) -> Optional[str]:
    """``"causal"``, ``"full"`` or ``None`` (keep the mask) for a boolean mask over
    ``queries x keys``. The verdict for a mask tensor is remembered until it is written to, so the
    layers of one forward (and its recompute) look at the shared mask once."""
    if (torch.compiler.is_compiling() or type(mask) is not torch.Tensor
            or mask.dtype is not torch.bool
            or mask.device.type == "meta" or mask.dim() < 2
            or tuple(mask.shape[-2:]) != (queries, keys)):
        return None
    try:
        key = (mask._version, mask.data_ptr(), tuple(mask.shape), mask.stride())
    except RuntimeError:  # a functorch-wrapped tensor (vmap, functionalization): no storage
        return None
    seen = getattr(_local, "seen", None)
    if seen is not None and seen[0]() is mask and seen[1] == key:
        return seen[2]
    # Out of sight of dispatch modes: a selective-checkpoint mode counting a kept node's calls
    # must see the same calls in the forward and in the recompute (which finds the verdict here).
    with _disable_current_modes():
        kind = kind_of(mask, queries, keys)
    _local.seen = (weakref.ref(mask), key, kind)
    return kind


def kind_of(mask: torch.Tensor, queries: int, keys: int) -> Optional[str]:
    """``"causal"``, ``"full"`` or ``None`` for a boolean mask with values, looked at now (no
    memory of earlier verdicts; capture calls it on a mask it computed from sizes, also while
    Dynamo compiles)."""
    if bool(mask.all()):
        return FULL
    causal = torch.ones(queries, keys, dtype=torch.bool, device=mask.device).tril()
    return CAUSAL if torch.equal(mask, causal.expand(mask.shape)) else None
