"""What a compiled training step keeps for backward, asked of AOTAutograd's own partitioner.

A plan's peak is verified on the eager step (:mod:`fxckpt.measure.verify`). Under
``torch.compile`` the step keeps less: AOTAutograd's min-cut partitioner (inductor's) recomputes
cheap ops outside the checkpointed segments too, and what a fused kernel computes never reaches
memory. The bench's GPT-2, given ``torch.compile``'s own peak as its budget, held 0.69 of it
compiled: memory the budget allowed, spent on recompute.

So for a step that runs compiled, the plan is checked against the compiled step instead. Nothing
here imitates the partitioner: the rewritten graph is compiled with a recording backend, and the
joint graph AOTAutograd traces (on fake tensors: no memory, no kernel, no side effect on the
model) is partitioned twice, by the two partitioners torch has, before compilation is stopped:

* ``default_partition`` keeps what the eager step keeps (the forward's values the backward
  reads; the checkpointed segments still recomputed);
* ``min_cut_rematerialization_partition``, with inductor's decompositions and the
  ``activation_memory_budget`` in force, keeps what the compiled step keeps.

A training step peaks as backward starts, holding what the forward kept and what the loss holds:
the compiled step's peak is estimated as the second figure plus the loss's own peak (its
outputs and their gradients included), measured once on fake outputs. Values that are views of
a parameter or an input are not counted (they hold no memory of their own).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
import torch.fx
import torch.utils._pytree as pytree

from fxckpt.errors import Partitioned, VerifyError
from fxckpt.measure.verify import LossFn
from fxckpt.runtime.state import set_torch_states, torch_states

__all__ = ["Saved", "compiled_saved", "CompiledPeak"]


@dataclasses.dataclass(frozen=True)
class Saved:
    """Bytes the forward of one training step keeps for its backward."""

    eager: int
    """As the eager step keeps them (``default_partition``)."""
    compiled: int
    """As the compiled step keeps them (the min-cut partitioner, inductor's decompositions)."""


def compiled_saved(run: Callable[[tuple, dict], Any], args: tuple, kwargs: dict) -> Saved:
    """What one training step of ``run(args, kwargs)`` keeps for backward, eagerly and compiled.

    ``run`` is traced by Dynamo and AOTAutograd (on fake tensors, which they make), and stopped
    once its joint graph is partitioned: no kernel runs, no state changes, no memory is taken.
    Raises :class:`~fxckpt.errors.VerifyError` when the step cannot be traced so. A step that
    Dynamo splits into several graphs is measured by its first.
    """
    found: list[Saved] = []

    def step(a: tuple, k: dict) -> Any:
        return run(a, k)

    # Dynamo keeps its compiled code on the code object, guarded on what it read: a copy of the
    # code makes this probe compile afresh, and its cache entry goes with the function.
    step.__code__ = step.__code__.replace()
    states = torch_states()  # tracing draws a seed for the graph's random ops
    try:
        # suppress_errors would run the frame eagerly once the backend stops: for real
        with torch.compiler.set_stance("default"), \
                torch._dynamo.config.patch(suppress_errors=False):
            torch.compile(step, backend=_recorder(found), dynamic=False)(args, kwargs)
    except Exception as e:
        if not found:
            raise VerifyError(f"the step could not be traced to see what torch.compile keeps: "
                              f"{type(e).__name__}: {e}") from e
    finally:
        set_torch_states(states)
    if not found:
        raise VerifyError("the compiled step made no training graph: nothing to measure")
    return found[0]


class CompiledPeak:
    """The peak of a training step as ``torch.compile`` runs it, estimated: what the compiled
    forward keeps (:func:`compiled_saved`) plus what the loss holds at its peak, its outputs and
    their gradients included (:func:`~fxckpt.measure.loss_probe.fake_loss_peak`, measured once:
    it is the same for every plan). A training step peaks as backward starts, holding both.

    ``run(gm, args, kwargs)`` calls a rewritten graph as the model is called; ``loss_fn`` is
    the user's (``None``: the stand-in loss verification uses).
    """

    def __init__(self, root: torch.nn.Module, run: Callable[[torch.fx.GraphModule, tuple, dict],
                                                             Any],
                 args: tuple, kwargs: dict, loss_fn: Optional[LossFn], device: str) -> None:
        self.root, self.run, self.args, self.kwargs = root, run, args, kwargs
        self.loss_fn, self.device = loss_fn, device
        self.loss_bytes: Optional[int] = None
        self.last: Optional[tuple[torch.fx.GraphModule, int]] = None
        """The graph last measured and its peak (the same graph is asked for more than once)."""

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        if self.last is not None and self.last[0] is gm:
            return self.last[1]
        saved = compiled_saved(lambda a, k: self.run(gm, a, k), self.args, self.kwargs)
        if self.loss_bytes is None:
            self.loss_bytes = self._loss(gm)
        self.last = (gm, saved.compiled + self.loss_bytes)
        return self.last[1]

    def _loss(self, gm: torch.fx.GraphModule) -> int:
        """What the loss holds at its peak, on fake outputs laid out as ``gm``'s (made by a run
        on fake tensors, without autograd)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        from fxckpt.measure.loss_probe import TensorLayout, fake_loss_peak, output_layout
        from fxckpt.measure.meta_run import fake_twin
        from fxckpt.measure.verify import _swapped_state

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        memo: dict[int, torch.Tensor] = {}

        def fake(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in memo:
                memo[id(t)] = fake_twin(mode, t)
            return memo[id(t)]

        with _swapped_state(gm, fake), mode, torch.no_grad():
            a, k = pytree.tree_map_only(torch.Tensor, fake, (self.args, self.kwargs))
            layout = output_layout(self.run(gm, a, k))
        if layout is None:
            raise VerifyError("the compiled step's output could not be laid out for its loss")
        # Run without autograd, the outputs want no gradient; in the training step the floating
        # ones do (the loss's backward makes their gradients).
        layout = dataclasses.replace(layout, leaves=tuple(
            dataclasses.replace(leaf, requires_grad=leaf.dtype.is_floating_point)
            if isinstance(leaf, TensorLayout) else leaf for leaf in layout.leaves))
        return fake_loss_peak(self.root, layout, self.args, self.kwargs,
                              loss_fn=self.loss_fn or _stand_in, device=self.device)


def _stand_in(output: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The stand-in loss verification uses, of the output alone (a zero when it has none)."""
    from fxckpt.measure.verify import stand_in_loss

    loss = stand_in_loss(output)
    return torch.zeros(()) if loss is None else loss


def _recorder(found: list[Saved]) -> Any:
    """A dynamo backend: AOTAutograd with a partition function that partitions each joint graph
    both ways, records what each keeps, and hands on the min-cut partition (run eagerly)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import (default_partition,
                                               min_cut_rematerialization_partition)
    from torch._inductor.decomposition import select_decomp_table

    def partition(joint: torch.fx.GraphModule, inputs: Any, **kw: Any) -> Any:
        from fxckpt.capture.graphs import copy_graph_module

        n = kw["num_fwd_outputs"]
        eager_fw, _ = default_partition(copy_graph_module(joint), inputs, **kw)
        fw, _ = min_cut_rematerialization_partition(joint, inputs, compiler="inductor", **kw)
        found.append(Saved(_saved_bytes(eager_fw, n), _saved_bytes(fw, n)))
        raise Partitioned

    def never(gm: torch.fx.GraphModule, _: Any) -> Any:  # pragma: no cover - partition raises
        raise Partitioned

    return aot_autograd(fw_compiler=never, bw_compiler=never, partition_fn=partition,
                        decompositions=select_decomp_table())


def _saved_bytes(fw: torch.fx.GraphModule, outputs: int) -> int:
    """Bytes of the forward graph's saved values: its outputs past the first ``outputs``, less
    inputs and views of them."""
    from torch._functorch.partitioners import _size_of
    from torch.multiprocessing.reductions import StorageWeakRef

    def storage(node: torch.fx.Node) -> Any:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        return StorageWeakRef(val.untyped_storage())

    inputs = {storage(n) for n in fw.graph.nodes if n.op == "placeholder"} - {None}
    out = next(n for n in fw.graph.nodes if n.op == "output")
    seen: set[Any] = set()
    total = 0
    for node in out.args[0][outputs:]:
        ref = storage(node) if isinstance(node, torch.fx.Node) else None
        if ref is None or ref in inputs or ref in seen:
            continue
        seen.add(ref)
        total += int(_size_of(node))
    return total
