"""The pass pipeline: capture once, then annotate -> select -> lower per plan.

    model --capture--> GraphModule ............................. (once per mode and call structure)
          --copy--> --annotate--> costed graph --select--> Plan --lower--> rewritten GraphModule
                                                                  (segments call fxckpt.checkpoint)
                                   (a budget: --fit--> verify on fake tensors, tighten, repeat)

Capture is the slow step (seconds with ``torch.export``) and is shape-free where it can be, so
the transformed module captures once and plans on copies of the captured graph: once in all,
or once per input shape when the plan depends on shapes (a memory budget).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Optional

import torch
import torch.fx

from fxckpt.config import TransformConfig
from fxckpt.errors import (BudgetInfeasibleError, ConfigError, FxckptError, PlanError,
                           VerifyError)
from fxckpt.pipeline.build import PipelinedModule, build_pipeline
from fxckpt.runtime.microbatch import batch_size, scatter
from fxckpt.cost.annotate import annotate
from fxckpt.cost.fused_attention import fused_attention, plans_fused
from fxckpt.capture.captured import capture
from fxckpt.planning.select import select
from fxckpt.capture.captured import Captured
from fxckpt.planning.fit import Target, Verify, fit
from fxckpt.capture.graphs import copy_graph_module
from fxckpt.capture.sharding import full_parameters, recomputable
from fxckpt.capture.traceless import hooks_off, weight_computing_hooks
from fxckpt.plan import Plan
from fxckpt.runtime.assign import assign
from fxckpt.runtime.segment import Offloading
from fxckpt.signature import describe_signature, variant_key
from fxckpt.measure.loss_probe import LossProbe
from fxckpt.measure.verify import STAND_IN, fake_step_peak
from fxckpt.measure.compiled_step import CompiledPeak

__all__ = ["Compiled", "capture_for", "build", "first_micro_batch"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Compiled:
    """What the transformed module runs for one plan: the rewritten graph, its plan, its stages."""

    captured: Captured
    gm: torch.fx.GraphModule
    plan: Plan
    pipeline: Optional[PipelinedModule] = None
    """The pipelined module (``fxckpt.pipeline.build.PipelinedModule``) when stages were asked for.
    """
    variant_key: Any = None
    """The :func:`~fxckpt.signature.variant_key` of the call it was planned for (what an
    export matches calls by)."""

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        if self.pipeline is not None and not _batch_is_dynamic(self.captured):
            _check_even_split(self.pipeline.chunks, args, kwargs)
        return self.captured.call(self.pipeline or self.gm, args, kwargs)


def capture_for(
    model: torch.nn.Module, config: TransformConfig, args: tuple, kwargs: dict,
    live: Optional[torch.nn.Module] = None,
) -> Captured:
    """Capture ``model`` (a view of ``live``) for calls like ``model(*args, **kwargs)`` (one
    micro-batch, for stages)."""
    plan_args, plan_kwargs = first_micro_batch(config, args, kwargs)
    return capture(model, plan_args, plan_kwargs, method=config.graph_method, live=live)


def build(captured: Captured, config: TransformConfig, args: tuple, kwargs: dict, *,
          training: bool, model: torch.nn.Module, eager_peak: Optional[int] = None,
          offloader: Optional[Offloading] = None, compiled_step: bool = False) -> Compiled:
    """Plan and rewrite a copy of the captured graph for calls like ``model(*args, **kwargs)``.

    ``eager_peak``: the unmodified step's verified peak for such calls when already measured
    (:mod:`fxckpt.serve.plan_cache` checked a plan with no segments there); not measured
    again unless a ``loss_fn`` must see the step's output. ``offloader``: the transformed
    module's, which the segments a plan offloads run under (``offload="auto"``).

    A failure inside fxckpt's passes surfaces as an :class:`~fxckpt.errors.FxckptError` naming
    the model and the pass, never as a bare ``KeyError`` from the internals.
    """
    start = time.perf_counter()
    try:
        compiled = _build(captured, config, args, kwargs, training, model, eager_peak, offloader,
                          compiled_step)
    except FxckptError:
        raise
    except Exception as e:
        raise PlanError(
            f"fxckpt could not plan {type(model).__name__} ({captured.method} graph) for "
            f"{describe_signature(args, kwargs)}: {type(e).__name__}: {e}. This is a limitation "
            "of fxckpt for this model; please report it with the model's class and this message"
        ) from e
    log.info("planned %s for %s in %.2fs", type(model).__name__, compiled.plan.signature,
             time.perf_counter() - start)
    return compiled


def peak_at(compiled: Compiled, config: TransformConfig, args: tuple, kwargs: dict,
            model: torch.nn.Module) -> Optional[int]:
    """The verified peak of ``compiled``'s plan for calls like these (``None`` when the step
    cannot run on fake tensors): what lets a plan serve larger calls without planning again."""
    plan_args, plan_kwargs = first_micro_batch(config, args, kwargs)
    hooked = [model.get_submodule(p) for p in compiled.captured.hooked]
    verify = _verifier(compiled.captured, config, plan_args, plan_kwargs, hooked,
                       _device_of(model))
    try:
        return verify(compiled.gm)
    except VerifyError:
        return None


def _build(captured: Captured, config: TransformConfig, args: tuple, kwargs: dict, training: bool,
           model: torch.nn.Module, eager_peak: Optional[int] = None,
           offloader: Optional[Offloading] = None, compiled_step: bool = False) -> Compiled:
    plan_args, plan_kwargs = first_micro_batch(config, args, kwargs)
    if config.pipelined:
        _refuse_assignments(captured.gm)
    if config.pipelined and not _batch_is_dynamic(captured):
        _check_even_split(config.chunks or 1, args, kwargs)
    gm = copy_graph_module(captured.gm)
    gm.training = training
    hooked = [model.get_submodule(p) for p in captured.hooked]
    # The user's hooks must not fire on annotate's fake tensors (nor FSDP's all-gathers).
    fused = plans_fused(config.device_profile, _device_of(model))
    with hooks_off(hooked), full_parameters(model), fused_attention(fused):
        annotate(gm, captured.graph_args(plan_args, plan_kwargs))
    # Hooked modules stay out of segments, but FSDP's: they gather their parameters again.
    never_recomputed = {p for p, m in zip(captured.hooked, hooked) if not recomputable(m)}
    hooked_nodes = {n.name: str(n.target) for n in gm.graph.nodes
                    if n.op == "call_module" and str(n.target) in never_recomputed}
    probe: Optional[LossProbe] = None  # what the user's loss holds, measured when verified

    def plan_at(target: Target) -> Plan:
        return select(gm, config, capture=captured.method, training=training,
                      signature=describe_signature(args, kwargs), hooked=hooked_nodes,
                      target=target,
                      loss_bytes=probe.peak(gm) if probe is not None else None)

    verify = None
    if training and config.verifies and not any(captured.sharding) and not _offloads_in_place(
            config, model):
        if config.loss_fn is not None:
            probe = LossProbe(config.loss_fn, plan_args, plan_kwargs, _device_of(model))
        verify = _verifier(captured, config, plan_args, plan_kwargs, hooked, _device_of(model),
                           probe)
    if verify is not None and compiled_step and config.budget is not None:
        peak = CompiledPeak(model, captured.call, plan_args, plan_kwargs, config.loss_fn,
                            _device_of(model))
        plan, gm = _fit_compiled(gm, plan_at, verify, _compiled_verifier(peak, hooked),
                                 offloader, eager_peak if probe is None else None)
    else:
        plan, gm = fit(gm, plan_at, verify, solved=config.budget is not None,
                       loosen=config.loss_fn is not None,
                       eager=eager_peak if verify is not None and probe is None else None,
                       offloader=offloader)
    if verify is not None and config.loss_fn is None and config.budget is not None:
        plan = dataclasses.replace(plan, notes=plan.notes + (
            f"no loss_fn: verified with a stand-in loss that holds {STAND_IN}; pass "
            "loss_fn= to fit the plan to your loss",))
    pipeline = None
    if config.pipelined:
        pipeline = build_pipeline(
            gm,
            plan,
            chunks=config.chunks or 1,
            devices=list(config.devices or [_device_of(model)]),
            checkpoint=config.checkpoint,
            stages=config.stages,
            balance=None if config.balance is None else list(config.balance),
        )
        plan = dataclasses.replace(plan, pipeline=pipeline.view())
    return Compiled(captured, gm, plan, pipeline, variant_key(training, args, kwargs))


def _refuse_assignments(gm: torch.fx.GraphModule) -> None:
    """A pipeline runs the forward once per micro-batch: an attribute the forward assigns would
    hold the last micro-batch's value, not the batch's."""
    targets = [getattr(gm, str(n.args[0].target)) for n in gm.graph.nodes
               if n.op == "call_function" and n.target is assign]
    if targets:
        raise PlanError(
            f"the forward assigns {', '.join(f'`{t.where}`' for t in targets)}, and a pipeline "
            "runs it once per micro-batch, so the attribute would hold the last micro-batch's "
            "value instead of the batch's. Return the value from forward instead, or train "
            "without chunks/devices"
        )


def _verifier(captured: Captured, config: TransformConfig, args: tuple, kwargs: dict,
              hooked: list[torch.nn.Module], device: str,
              probe: Optional[LossProbe] = None) -> Verify:
    """The verified peak of a training step of a graph for these inputs
    (:mod:`fxckpt.measure.verify`); ``probe`` sees the first step's output."""
    def verify(gm: torch.fx.GraphModule) -> int:
        def run(a: tuple, k: dict) -> Any:
            output = captured.call(gm, a, k)
            return output if probe is None else probe.saw(output)

        with hooks_off(hooked, spare=weight_computing_hooks()), \
                fused_attention(plans_fused(config.device_profile, device)):
            return fake_step_peak(gm, run, args, kwargs, loss_fn=config.loss_fn, device=device)
    return verify


COMPILED_KEEPS = ("mm", "addmm", "bmm", "baddbmm", "convolution",
                  "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_cudnn_attention")
"""The ops whose outputs a segment of a plan fitted to the compiled step keeps first: the
costly ones to run again. Inductor recomputes the pointwise ops between them fused into the
backward's kernels, where they cost next to nothing (GPT-2 of the bench, every block so
checkpointed and compiled: 0.96x the step of ``torch.compile`` at ``activation_memory_budget``
0.5, against 1.08x with every op recomputed)."""


def _fit_compiled(gm: torch.fx.GraphModule, plan_at: Callable[[Target], Plan], verify: Verify,
                  compiled: Verify, offloader: Optional[Offloading],
                  eager: Optional[int]) -> tuple[Plan, torch.fx.GraphModule]:
    """A budget plan fitted to the compiled step (``compiled`` measures it; ``verify`` the eager
    step, ``eager`` its unmodified peak when known): segments that keep :data:`COMPILED_KEEPS`
    when such a plan fits, else segments that recompute everything; either widened to spend the
    memory the budget allows (:func:`fxckpt.planning.fit.fit`). A fraction is of the eager step,
    as without compile: the same budget in bytes either way. Where the compiled step cannot be
    measured, or no plan fits it, the plan is fitted to the eager step, which holds more."""
    def keeping(target: Target) -> Plan:
        plan = plan_at(target)
        return dataclasses.replace(plan, segments=tuple(
            dataclasses.replace(s, compiled_keeps=COMPILED_KEEPS) for s in plan.segments))

    def fitted_eagerly(why: str, measured: Optional[int]) -> tuple[Plan, torch.fx.GraphModule]:
        plan, fitted = fit(gm, plan_at, verify, eager=measured, offloader=offloader)
        note = f"fitted to the eager step, not as torch.compile runs it: {why}"
        return _note(plan, note), fitted

    try:
        eager = eager if eager is not None else verify(gm)
        compiled(gm)  # VerifyError now, if the step cannot be measured compiled
    except VerifyError as e:
        log.warning("fxckpt: fitting the plan to the eager step: %s", e)
        return fitted_eagerly(str(e), eager)
    for family in (keeping, plan_at):
        try:
            plan, fitted = fit(gm, family, compiled, offloader=offloader, widen=True,
                               fraction_of=eager)
        except BudgetInfeasibleError:
            continue
        return _note(plan, "fitted to the step as torch.compile runs it: its peak is what the "
                           "compiled forward keeps for backward (AOTAutograd's partitioner, "
                           "traced on fake tensors) plus what the loss holds"), fitted
    log.info("fxckpt: no plan fits the compiled step's estimate; fitted to the eager step")
    return fitted_eagerly("no plan fits the budget by the compiled step's estimate", eager)


def _note(plan: Plan, note: str) -> Plan:
    return dataclasses.replace(plan, notes=plan.notes + (note,))


def _compiled_verifier(peak: CompiledPeak, hooked: list[torch.nn.Module]) -> Verify:
    """``peak`` as a verifier: the user's hooks stay off while the step is compiled."""
    def verify(gm: torch.fx.GraphModule) -> int:
        with hooks_off(hooked, spare=weight_computing_hooks()):
            return peak(gm)
    return verify


def _offloads_in_place(config: TransformConfig, model: torch.nn.Module) -> bool:
    """Offload to the model's own device (CPU tests of the machinery) saves nothing a tracker
    of that device could see: such plans keep their simulated figures."""
    return bool(config.offload) and str(config.offload_device or "cpu") == _device_of(model)


def first_micro_batch(config: TransformConfig, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Stages run one micro-batch at a time: plan (and capture, for export) at that shape."""
    if not config.pipelined or not config.chunks:
        return args, kwargs
    return scatter(args, kwargs, config.chunks)[0]


def _batch_is_dynamic(captured: Captured) -> bool:
    """Does the graph take any batch size (dim 0 of its tensor inputs), so micro-batches may vary?

    An exported graph's batch range starts at 2 (export specialises sizes 0 and 1); a last
    micro-batch of 1 runs through it as well, as torchgpipe allows.
    """
    rule = captured.shape_rule
    return rule is None or all(dims[0][0] != dims[0][1] for dims in rule.dims if dims)


def _check_even_split(chunks: int, args: tuple, kwargs: dict) -> None:
    batch = batch_size(args, kwargs)
    if batch and batch >= chunks and batch % chunks:
        raise ConfigError(
            f"torch.export specialised this graph to one micro-batch size (the model's Python "
            f"depends on the batch size), so the batch ({batch}) must split evenly into "
            f"chunks={chunks}; use a batch that is a multiple of {chunks}, or a model "
            "symbolic_trace can capture"
        )


def _device_of(model: torch.nn.Module) -> str:
    first = next(iter(model.parameters()), None)
    return "cpu" if first is None else str(first.device)
