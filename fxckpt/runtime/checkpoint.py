"""Exact recompute: the function every rewritten graph calls for a segment.

``checkpoint(segment, *inputs)`` runs ``segment`` without keeping its intermediate tensors and
runs it again in backward when autograd needs them. It is PyTorch's non-reentrant checkpoint
(``use_reentrant=False``), which already gives what our users rely on: ``.backward()`` and
``torch.autograd.grad`` both work, CPU and CUDA RNG states are replayed so dropout draws the
same mask, autocast is re-entered during recompute, non-tensor inputs and outputs pass through,
and parameter gradients arrive even when no input requires grad. On top of it fxckpt adds:

* generators of the model's own the segment draws from (``torch.randn(..., generator=g)``) are
  replayed like the global ones: their states from before the first run are set for the
  recompute and put back after it, so the noise is the same and each generator advances once
  per step;
* segments running an op torch's early stop gets wrong (``rrelu_with_noise``) recompute to
  their end (:data:`~fxckpt.runtime.segment.NO_EARLY_STOP`);
* buffers the segment writes in place (BatchNorm ``running_mean``/``running_var``/
  ``num_batches_tracked``, a step counter) are set back to their values from before the first
  run while it is recomputed, and to their values after it once the recompute is done: the
  recompute reads what the first run read, and a training step updates them once;
* torch function modes of the first run that ask to be (:data:`REPLAYED`) are entered again for
  the recompute;
* a recompute whose saved tensors differ from the first run's (shape, dtype, device) raises
  PyTorch's ``CheckpointError``, whose metadata names the segment and the tensor position;
* in ``eval()`` or under ``torch.no_grad()`` the segment is simply called: no overhead;
* while a :mod:`~fxckpt.runtime.clock` is on (a few steps, to refine the plan's prices), the
  segment's first run is timed;
* a segment with kept nodes (selective recompute) keeps their outputs from forward and hands them
  to the recompute instead of running their main op again (:mod:`fxckpt.runtime.selective`);
  such a segment can be backpropagated through once.

    forward:   inputs --segment (no grad, nothing kept)--> outputs        [keeps: inputs, and
                                                                           written buffers' values]
    backward:  buffers as before forward; inputs --segment again (kept)--> grads flow;
               buffers as after forward
"""

from __future__ import annotations

import functools
import logging
import threading
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.overrides import _get_current_function_mode_stack

from fxckpt.runtime.clock import running_clock
from fxckpt.runtime.segment import Recomputable
from fxckpt.runtime.selective import Keeper
from fxckpt.runtime.state import (
    TensorValues,
    copies,
    generator_states,
    put,
    set_generator_states,
)


__all__ = ["checkpoint", "is_recomputing"]

log = logging.getLogger(__name__)
_local = threading.local()

REPLAYED = "replayed_in_recompute"
"""A torch function mode with this attribute true, active in a segment's first run, is entered
again for its recompute (the autograd engine runs it without the caller's modes). Only modes
that ask: a user's mode (one that logs, say) sees the forward once, as without fxckpt. Planning
on the meta device asks it of its fused-attention mode (:mod:`fxckpt.cost.fused_attention`)."""


def is_recomputing() -> bool:
    """True while a segment is being recomputed in backward (on this thread)."""
    return getattr(_local, "depth", 0) > 0


def _metadata(x: torch.Tensor) -> dict[str, Any]:
    """What torch's recompute check compares; the segment's name makes a mismatch say where."""
    return {
        "segment": getattr(_local, "segment", None),
        "shape": x.shape,
        "dtype": x.dtype,
        "device": x.device,
    }


# torch keeps its determinism checks in a private table; fall back to its default if it moves.
_CHECKS = getattr(torch_checkpoint, "_allowed_determinism_checks_to_fns", None)
if isinstance(_CHECKS, dict):
    _CHECKS.setdefault("fxckpt", _metadata)
    _DETERMINISM = "fxckpt"
else:  # pragma: no cover - other torch versions
    _DETERMINISM = "default"


def checkpoint(segment: torch.nn.Module, *inputs: Any) -> Any:
    """Run ``segment(*inputs)`` and recompute it in backward instead of keeping its activations."""
    if not (segment.training and torch.is_grad_enabled()):
        return segment(*inputs)
    if torch.compiler.is_dynamo_compiling():  # not under non-strict export: that runs this code
        return _traced_checkpoint(segment, inputs)
    call = _SegmentCall(segment, inputs)
    run: Callable[..., Any] = segment
    written = getattr(segment, "restored_inputs", ())
    if written:  # state it writes goes by closure: torch's checkpoint would save (and version-
        # check) its inputs, and the write in the first run bumps their version
        run, inputs = _state_by_closure(segment, inputs, written)
    clock = running_clock()
    timed = clock.run(segment, _device(inputs)) if clock is not None else nullcontext()
    with timed, torch_checkpoint.set_checkpoint_early_stop(getattr(segment, "early_stop", True)):
        return torch_checkpoint.checkpoint(
            run,
            *inputs,
            use_reentrant=False,
            preserve_rng_state=getattr(segment, "draws", True),
            context_fn=call.contexts,
            determinism_check=_DETERMINISM,
        )


def _device(inputs: tuple) -> Optional[torch.device]:
    """The device of a segment's first tensor input (whose clock times it)."""
    return next((a.device for a in inputs if isinstance(a, torch.Tensor)), None)


def _state_by_closure(segment: torch.nn.Module, inputs: tuple,
                      written: tuple[int, ...]) -> tuple[Callable[..., Any], tuple]:
    """``segment`` as a function of its other inputs, the state inputs it writes (a Dynamo
    graph's BatchNorm statistics) bound: restored around the recompute, not saved."""
    state = {i: inputs[i] for i in written}

    def run(*args: Any) -> Any:
        return segment(*(state.get(i, a) for i, a in enumerate(args)))

    return run, tuple(None if i in state else a for i, a in enumerate(inputs))


def _traced_checkpoint(segment: torch.nn.Module, inputs: tuple) -> Any:
    """Under ``torch.compile``: torch's checkpoint without a ``context_fn``, which dynamo turns
    into its ``tag_activation_checkpoint`` op; AOTAutograd's partitioner then recomputes the
    segment's ops in backward from what it saved, in one graph with the rest of the forward.

    Buffers the segment writes are first set from copies taken before it runs: a no-op in the
    forward, but the recompute reads those copies, not the updated buffers (which AOTAutograd
    would otherwise hand it, pytorch/pytorch#197039). Segment names and the recompute check are
    eager-only: the compiled recompute is part of the graph.

    A segment with ``compiled_keeps`` (and no buffer to restore: the policy sees every op of the
    region, and a restore writes in place) passes torch's selective-checkpoint policy as its
    ``context_fn``, which Dynamo accepts: the outputs of those ops are saved, the rest recomputed.
    """
    buffers = _restored(segment)
    keeps: frozenset[str] = getattr(segment, "compiled_keeps", frozenset())
    if keeps and not buffers:
        return torch_checkpoint.checkpoint(
            segment, *inputs, use_reentrant=False, preserve_rng_state=True,
            context_fn=functools.partial(torch_checkpoint.create_selective_checkpoint_contexts,
                                         functools.partial(_keep_ops, keeps)))
    before = copies(buffers)  # plain functions: Dynamo traces them

    def run(*args: Any) -> Any:
        put(buffers, before)
        return segment(*args)

    return torch_checkpoint.checkpoint(run, *inputs, use_reentrant=False, preserve_rng_state=True)


def _keep_ops(keeps: frozenset[str], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """The compiled recompute's policy: save the outputs of the ops named in ``keeps``."""
    name = getattr(getattr(op, "overloadpacket", None), "__name__", "")
    policy = torch_checkpoint.CheckpointPolicy
    return policy.MUST_SAVE if name in keeps else policy.PREFER_RECOMPUTE


# Generated code reads `fxckpt_checkpoint(segment_0, x)`; `fxckpt.checkpoint` is the public name.
checkpoint.__module__ = "fxckpt"


class _Named:
    """Names the segment whose tensors are being saved, for the recompute check's messages."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        self.outer = getattr(_local, "segment", None)
        _local.segment = self.name

    def __exit__(self, *exc: Any) -> None:
        _local.segment = self.outer


class _FirstRun(_Named):
    """The forward context: names the segment and keeps the values of the buffers it writes."""

    def __init__(self, call: "_SegmentCall") -> None:
        super().__init__(call.name)
        self.call = call

    def __enter__(self) -> None:
        super().__enter__()
        self.call.modes = [m for m in _get_current_function_mode_stack()
                           if getattr(m, REPLAYED, False)]
        self.call.before = TensorValues(self.call.buffers)
        self.call.drawn_from = generator_states(self.call.generators)
        if self.call.keeper is not None:
            self.call.keeper.enter("forward")

    def __exit__(self, *exc: Any) -> None:
        if self.call.keeper is not None:
            self.call.keeper.leave()
        super().__exit__(*exc)


class _SegmentCall:
    """The recompute context of one checkpointed call; re-entrant (``retain_graph`` recomputes
    again).

    The buffers a segment writes are named by whoever built it (:attr:`Recomputable.restores`;
    the planner, from the ops it saw write them); version counters cannot tell, since kernels
    such as ``native_batch_norm`` update running statistics without bumping them.
    """

    def __init__(self, segment: torch.nn.Module, inputs: tuple = ()) -> None:
        self.segment = segment
        self.name = segment.name if isinstance(segment, Recomputable) else type(segment).__name__
        self.buffers = _restored(segment) + [
            inputs[i] for i in getattr(segment, "restored_inputs", ())]
        self.before = TensorValues()
        self.after = TensorValues()
        self.generators: tuple[torch.Generator, ...] = getattr(segment, "generators", ())
        self.drawn_from: list[torch.Tensor] = []
        """The generators' states when the first run began (replayed by the recompute)."""
        self.states_now: list[torch.Tensor] = []
        self.keeper = Keeper(self.name) if getattr(segment, "kept", 0) else None
        self.modes: list[Any] = []
        """Torch function modes of the first run that ask to be replayed (:data:`REPLAYED`)."""
        self.entered: list[Any] = []

    def contexts(self) -> tuple[_FirstRun, "_SegmentCall"]:
        return _FirstRun(self), self

    def __enter__(self) -> None:
        log.debug("recomputing %s", self.name)
        self.after = TensorValues(self.buffers)
        self.before.restore()  # the recompute reads what the first run read
        self.states_now = generator_states(self.generators)
        set_generator_states(self.generators, self.drawn_from)  # and draws what it drew
        _local.depth = getattr(_local, "depth", 0) + 1
        # Left set on exit: torch compares the recomputed tensors' metadata right after this.
        _local.segment = self.name
        # The autograd engine runs the recompute without the caller's torch function modes.
        active = _get_current_function_mode_stack()
        self.entered = [m for m in self.modes if not any(a is m for a in active)]
        for mode in self.entered:
            mode.__enter__()
        if self.keeper is not None:
            self.keeper.enter("recompute")

    def __exit__(self, *exc: Any) -> None:
        if self.keeper is not None:
            self.keeper.leave()
        for mode in reversed(self.entered):
            mode.__exit__(None, None, None)
        self.entered = []
        _local.depth -= 1
        self.after.restore()
        self.after = TensorValues()
        set_generator_states(self.generators, self.states_now)


def _restored(segment: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers to restore around a recompute: a plain module names none."""
    return segment.restored_buffers() if isinstance(segment, Recomputable) else []
