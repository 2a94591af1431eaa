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
  core is recomputed and every other op's output is saved. The core is an attention kernel
  (``_scaled_dot_product_*``: fused attention saves nothing large, so this peer saves little
  there), or, where attention is decomposed into ``bmm``/``baddbmm`` (the math path of ``sdpa``
  that GPT-2's and BERT's attention dropout select on CPU, or eager attention), every op from
  the score ``bmm`` (an odd-numbered one within the block call) up to and including the next,
  the probabilities x values ``bmm``. Outside the core, views, in-place ops and tensor factories
  (``empty_like``, ``ones``...) are recomputed too: they cost nothing and store nothing of their
  own (saving an output that a later in-place op changes is also what the contexts refuse).
  A policy sees ops, not autograd's needs, so it saves some outputs autograd would have freed
  (a residual sum, a RoPE intermediate): the cost of stating Megatron's choice through these
  contexts, which is how a PyTorch user would state it.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Callable

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

__all__ = ["ATTENTION_OPS", "MATMUL_OPS", "SCORE_OPS", "Policy", "ops_policy", "megatron_policy",
           "context_fn", "POLICIES"]

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


def megatron_policy() -> Policy:
    """Megatron-style: recompute the attention core only, save every other op's output."""
    scores: collections.Counter[bool] = collections.Counter()

    def policy(ctx: SelectiveCheckpointContext, op: Op, *args: Any, **kwargs: Any
               ) -> CheckpointPolicy:
        mode = ctx.is_recompute
        if op in SCORE_OPS:
            scores[mode] += 1  # odd: the core starts here; even: it ends here
            return RECOMPUTE
        if op in ATTENTION_OPS or scores[mode] % 2 == 1 or _free(op):
            return RECOMPUTE
        return SAVE

    return policy


POLICIES: dict[str, Callable[[], Policy]] = {
    "sac_ops": ops_policy,
    "sac_megatron": megatron_policy,
}
"""Method name -> a maker of fresh policies (one per block call)."""


def context_fn(make_policy: Callable[[], Policy]) -> Callable[[], Any]:
    """``checkpoint``'s ``context_fn``: the selective contexts of a fresh policy per call."""
    return lambda: create_selective_checkpoint_contexts(make_policy())


def wrap(block: torch.nn.Module, make_policy: Callable[[], Policy]) -> None:
    """Make ``block(...)`` run its ``forward`` under ``checkpoint`` with the policy's contexts
    (an instance attribute shadows the class's ``forward``; ``__call__`` uses it)."""
    block.forward = functools.partial(  # type: ignore[method-assign]
        checkpoint, block.forward, use_reentrant=False, context_fn=context_fn(make_policy)
    )
