"""Op-level peers: per-block checkpoints whose recompute is chosen op by op through torch's
selective-checkpoint contexts.

Both wrap every block as ``checkpoint(block, ..., use_reentrant=False, context_fn=...)`` with
``context_fn`` returning ``create_selective_checkpoint_contexts(policy)``; the policy sees every
aten op the block runs, in forward and again in the recompute, and says ``MUST_SAVE`` (kept from
the forward) or ``PREFER_RECOMPUTE``. Each call of a block gets a fresh policy, whose counters
are kept apart for the forward and the recompute (``ctx.is_recompute``, as torchtitan does), so a
torch that asks the policy again in the recompute meets the forward's decisions (torch 2.13 asks
only in the forward and replays its decisions).

* ``sac_ops`` (torchtitan's op-level selective AC, ``_op_sac_save_list``): save the output of
  every attention kernel (``aten._scaled_dot_product_*_attention``, each variant this torch has)
  and of every other matmul: counting ``aten.mm`` and ``aten.addmm`` calls separately within one
  block call, the 1st, 3rd, 5th... of each are saved and the 2nd, 4th... recomputed; every other
  op is recomputed. (A Llama block's seven ``mm`` keep q, v, gate and down; on CPU its attention
  kernel is ``_scaled_dot_product_flash_attention_for_cpu``.)
* ``sac_megatron`` (Megatron-LM's ``--recompute-granularity selective``, which checkpoints only
  the "core attention": scores, mask, softmax, dropout, probabilities x values): the attention
  core is recomputed; outside it, what autograd would have kept is kept. The core is an
  attention kernel (``_scaled_dot_product_*``: a fused kernel keeps only q, k, v, its output and
  log-sum-exp, which autograd needs anyway, so this peer saves little there), or, where
  attention is decomposed into ``bmm``/``baddbmm`` (the math path of ``sdpa`` that GPT-2's and
  BERT's attention dropout select on CPU, or eager attention), every op from the score ``bmm``
  (an odd-numbered one within the block call) up to and including the next, the probabilities
  x values ``bmm``. Outside the core an op's output is saved when autograd saves it (found once
  per block by :func:`autograd_saved`, a first forward with ``saved_tensors_hooks``) or when it
  is a matmul; everything else (pointwise ops whose outputs autograd frees, views, in-place ops,
  factories) is recomputed, which is cheap. Why not simply save every op outside the core: the
  contexts keep every saved output until the backward, also those autograd would have freed
  (RoPE's intermediates, a norm's mean), which made this peer use 1.15-1.4x the unmodified
  model's memory on the Llama-style model. Why save every matmul: the recompute replays the
  whole block, so a matmul whose output autograd frees (q before RoPE, the output projection)
  would run again, which Megatron never does.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

__all__ = ["ATTENTION_OPS", "MATMUL_OPS", "SCORE_OPS", "Policy", "Key", "ops_policy",
           "megatron_policy", "autograd_saved", "POLICIES", "PROFILED", "Selective", "wrap"]

aten = torch.ops.aten
Op = torch._ops.OpOverload
Policy = Callable[..., CheckpointPolicy]
"""``policy(ctx, op, *args, **kwargs) -> CheckpointPolicy``."""

_ATTENTION_NAMES = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_scaled_dot_product_attention_math",
)
ATTENTION_OPS: frozenset[Op] = frozenset(
    getattr(aten, name).default for name in _ATTENTION_NAMES if hasattr(aten, name)
)
"""Every fused attention kernel this torch has (the math one is decomposed before dispatch on
most paths, but a backend may still call it)."""

MATMUL_OPS: frozenset[Op] = frozenset({aten.mm.default, aten.addmm.default})
"""The linear layers' matmuls (``nn.Linear`` and GPT-2's ``Conv1D`` on a 3-d input)."""

SCORE_OPS: frozenset[Op] = frozenset({aten.bmm.default, aten.baddbmm.default})
"""Decomposed attention's batched matmuls: scores (q x k^T) and probabilities x values."""

_FACTORIES = frozenset({"empty", "empty_like", "ones", "ones_like", "zeros", "zeros_like",
                        "full", "full_like", "scalar_tensor", "arange", "new_ones", "new_zeros",
                        "new_empty", "new_full", "_unsafe_view"})

SAVE, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE


def ops_policy() -> Policy:
    """torchtitan-style: save attention kernels and every other ``mm`` / ``addmm``."""
    counts: collections.Counter[tuple[bool, Op]] = collections.Counter()

    def policy(ctx: SelectiveCheckpointContext, op: Op, *args: Any, **kwargs: Any
               ) -> CheckpointPolicy:
        if op in ATTENTION_OPS:
            return SAVE
        if op in MATMUL_OPS:
            counts[ctx.is_recompute, op] += 1
            return SAVE if counts[ctx.is_recompute, op] % 2 == 1 else RECOMPUTE
        return RECOMPUTE

    return policy


def _free(op: Op) -> bool:
    """A view, an in-place op or a factory: recomputing it costs nothing."""
    return op.is_view or op._schema.is_mutable or op._opname in _FACTORIES


Key = tuple[Op, int]
"""An op and how many times it ran before in the same block call: the same in every call."""


def megatron_policy(saved: frozenset[Key]) -> Policy:
    """Megatron-style: recompute the attention core; outside it, save each matmul and each op
    whose output autograd saves (``saved``, from :func:`autograd_saved`), recompute the rest."""
    scores: collections.Counter[bool] = collections.Counter()
    seen: collections.Counter[tuple[bool, Op]] = collections.Counter()

    def policy(ctx: SelectiveCheckpointContext, op: Op, *args: Any, **kwargs: Any
               ) -> CheckpointPolicy:
        mode = ctx.is_recompute
        key = (op, seen[mode, op])
        seen[mode, op] += 1
        if op in SCORE_OPS:
            scores[mode] += 1  # odd: the core starts here; even: it ends here
            return RECOMPUTE
        if op in ATTENTION_OPS or scores[mode] % 2 == 1 or _free(op):
            return RECOMPUTE
        return SAVE if op in MATMUL_OPS or key in saved else RECOMPUTE

    return policy


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Producers(TorchDispatchMode):
    """Remembers which op (and its occurrence) last wrote each storage."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[Op] = collections.Counter()
        self.by_storage: dict[int, Key] = {}

    def __torch_dispatch__(self, func: Op, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in SAC_IGNORED_OPS:  # the selective contexts never show these to a policy
            return out
        key = (func, self.counts[func])
        self.counts[func] += 1
        if not _free(func):
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.by_storage[_storage(t)] = key
        return out


def autograd_saved(forward: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> frozenset[Key]:
    """The ops of one ``forward(*args, **kwargs)`` whose outputs autograd saves for backward.

    Runs it once with grad (the RNG state is put back after, so dropout draws the same masks
    in the real call); a saved tensor is traced to the last op that wrote its storage (a view
    to the op whose output it views)."""
    producers, saved = _Producers(), set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = producers.by_storage.get(_storage(t))
        if key is not None:
            saved.add(key)
        return t

    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        with saved_tensors_hooks(pack, lambda t: t), producers:
            forward(*args, **kwargs)
    return frozenset(saved)


POLICIES: dict[str, Callable[[frozenset[Key]], Policy]] = {
    "sac_ops": lambda saved: ops_policy(),
    "sac_megatron": megatron_policy,
}
"""Method name -> a maker of fresh policies (one per block call), given what autograd saves."""

PROFILED = frozenset({"sac_megatron"})
"""Policies that need :func:`autograd_saved` of the block first."""


class Selective:
    """A block's ``forward`` under ``checkpoint`` with a policy's selective contexts; for a
    :data:`PROFILED` policy, the first call with grad first finds what autograd saves."""

    def __init__(self, forward: Callable[..., Any], method: str) -> None:
        self.forward, self.method = forward, method
        self.saved: frozenset[Key] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.method in PROFILED and self.saved is None and torch.is_grad_enabled():
            self.saved = autograd_saved(self.forward, args, kwargs)
        return checkpoint(self.forward, *args, use_reentrant=False, context_fn=self.contexts,
                          **kwargs)

    def contexts(self) -> Any:
        """``checkpoint``'s ``context_fn``: the contexts of a fresh policy (one per call)."""
        policy = POLICIES[self.method](self.saved or frozenset())
        return create_selective_checkpoint_contexts(policy)


def wrap(block: torch.nn.Module, method: str) -> None:
    """Make ``block(...)`` run its ``forward`` through :class:`Selective` (an instance attribute
    shadows the class's ``forward``; ``__call__`` uses it)."""
    block.forward = Selective(block.forward, method)  # type: ignore[method-assign]
