"""``fxckpt.transform``: the one call users make."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from fxckpt.config import TransformConfig
from fxckpt.checks import check_example_inputs, check_model
from fxckpt.errors import ConfigError
from fxckpt.planning.pareto import pareto
from fxckpt.module import TransformedModule, dispatcher_of, is_transformed, make_transformed
from fxckpt.plan import Plan

__all__ = ["transform", "pareto"]


def transform(
    model: torch.nn.Module,
    *,
    every: Optional[int] = None,
    depth: Optional[int] = None,
    force: Optional[Mapping[str, str]] = None,
    budget: Optional[Union[int, float, str]] = None,
    chunks: Optional[int] = None,
    devices: Optional[Sequence[Union[str, torch.device]]] = None,
    checkpoint: str = "except_last",
    stages: Optional[int] = None,
    balance: Optional[Sequence[Union[int, str]]] = None,
    offload: Union[bool, str] = False,
    offload_device: Optional[Union[str, torch.device]] = None,
    offload_threshold: int = 1 << 20,
    offload_bandwidth: Optional[float] = None,
    plan: Optional[Union[Plan, Mapping[str, Any]]] = None,
    example_inputs: Optional[Sequence[Any]] = None,
    example_kwargs: Optional[Mapping[str, Any]] = None,
    loss_fn: Optional[Callable[..., torch.Tensor]] = None,
    verify: Optional[bool] = None,
    selective: bool = True,
    capture: str = "auto",
    device_profile: Optional[str] = None,
) -> TransformedModule:
    """Return ``model`` rewritten to recompute activations in backward instead of keeping them.

    Args:
        model: the ``nn.Module`` to transform. The result shares its parameters and buffers.
        every: checkpoint segments of ``every`` units of work (matmul / convolution nodes).
        depth: make each module at this nesting depth a segment (``layers.3`` has depth 2).
        force: ``{"module.path": "recompute" | "save"}`` pins parts of the model either way;
            applies on top of the strategy, or alone. ``{"op:aten.mm": "save"}`` pins an aten
            op instead: its outputs inside segments are kept from forward (``"recompute"``:
            never kept), with any strategy.
        budget: bound on the peak activation memory of a training step: a fraction in (0, 1] of
            the unmodified model's, a number of bytes, or a size such as ``"1.5GiB"`` (a
            unitless string reads as the number it spells: ``"0.5"`` is a fraction; ``1`` is
            refused as ambiguous). The solver picks the segments with the least recompute
            whose predicted peak fits.
        chunks: split each call's batch into this many micro-batches and run them as a GPipe
            pipeline over ``devices`` (one stage per device, balanced by cost).
        devices: the pipeline's devices, one per stage (``["cpu", "cpu"]`` works for testing).
        checkpoint: per micro-batch recompute of whole stages, as in torchgpipe:
            ``"always"``, ``"except_last"`` (default) or ``"never"``.
        stages: number of stages (default ``len(devices)``).
        balance: stage sizes in compute nodes, or the module paths where stages 1..K-1 begin.
        offload: ``True`` moves what checkpointing keeps (and other large saved tensors) to
            host memory in forward and back in backward; ``"auto"`` (with ``budget``) lets
            each segment either recompute or offload, whichever costs less.
        offload_device: where offloaded tensors live (default ``"cpu"`` when CUDA is present).
        offload_threshold: saved storages smaller than this (bytes) are not offloaded.
        offload_bandwidth: copy bandwidth (bytes/s) for ``offload="auto"``; measured if omitted.
        plan: a :class:`~fxckpt.plan.Plan` (or its ``to_dict()``) to replay: its segments are
            used as they are, without solving again. The model must capture to the same nodes.
        example_inputs: positional inputs to plan with now (in the model's current mode); without
            them fxckpt captures at the first training call, once per mode and call structure
            (non-tensor values, dtypes, devices), not per shape.
        example_kwargs: keyword inputs to plan with now.
        loss_fn: ``loss_fn(output, *args, **kwargs) -> scalar``, the loss the training step
            computes. A budget counts the loss's saved tensors too (cross-entropy over a large
            vocabulary keeps its log-probabilities); without it a stand-in loss is assumed.
        verify: run each training plan once on fake tensors (no memory) and record its verified
            peak (``fxckpt.inspect(tm).plan.verified_peak``). ``None`` (default) or ``True``:
            every training plan (``every``, ``depth``, ``force``, ``budget``: one verified peak
            whatever made the plan; budget plans are tightened until it fits). ``False``: the
            simulator's figures only (faster planning).
        selective: with ``budget``, let the solver keep some outputs inside segments (matmuls,
            attention: costly to run again per byte) instead of recomputing every op of a
            segment (docs/budget.md, "Selective recompute"). ``False``: whole segments.
        capture: how training calls become graphs: ``"auto"`` (default) runs each training
            call through TorchDynamo, which guards the Python the forward reads and breaks it
            into graphs where needed, and plans each graph (:mod:`fxckpt.serve.dynamo`); where an
            option needs one whole graph of the model (stages, ``offload="auto"``, ``plan=``,
            ``example_inputs=``, a model sharded with ``fully_shard``) it captures one with
            ``torch.fx.symbolic_trace``, falling back to ``torch.export``. ``"dynamo"``: Dynamo
            only (whole-graph options refused); ``"graph"``: one whole graph always;
            ``"symbolic_trace"`` or ``"export"``: one whole graph by that method only.
        device_profile: the device plans are priced for: ``"h100"``, ``"h200"``, ``"a100"`` or
            ``"cpu"``, when planning on one device for another (the CPU or ``meta`` for a
            GPU); ``None`` (default): the model's own device, measured (a GPU's rates, a CPU's
            prices per op: ``fxckpt.cost.cpu_table``; ``FXCKPT_CPU_PRICES=table`` keeps the
            table ``"cpu"`` names).

    With no strategy nothing is checkpointed, and the plan says so. The result is the model
    itself (its class, attributes and methods) with a rewritten training forward; read fxckpt's
    plan and code with :func:`fxckpt.inspect`.
    """
    check_model(model)
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise ConfigError(
            f"model is a torch.compile'd {type(model._orig_mod).__name__} (OptimizedModule), "
            "whose calls bypass fxckpt: nothing would be planned. Transform the model inside "
            "(fxckpt.transform(model._orig_mod, ...)); fxckpt compiles its training forward "
            "with Dynamo itself, and torch.compile(tm) with capture='graph' puts the plan in "
            "an inductor graph (docs/compile.md)"
        )
    if is_transformed(model):
        raise ConfigError(
            f"this {type(model).__name__} is already transformed; transform the original model "
            "(fxckpt.inspect(tm).model) with the new options instead"
        )
    config = TransformConfig.from_options(
        every=every,
        depth=depth,
        budget=budget,
        plan=_as_plan(plan),
        force={} if force is None else force,  # validate() checks it
        chunks=chunks,
        devices=None if devices is None else _as_tuple(devices, "devices"),
        checkpoint=checkpoint,
        stages=stages,
        balance=None if balance is None else _as_tuple(balance, "balance"),
        offload=offload,
        offload_device=None if offload_device is None else str(offload_device),
        offload_threshold=offload_threshold,
        offload_bandwidth=offload_bandwidth,
        loss_fn=loss_fn,
        verify=verify,
        selective=selective,
        capture=capture,
        device_profile=device_profile,
    ).validate(model)
    tm = make_transformed(model, config)
    if example_inputs is not None or example_kwargs is not None:
        inputs = check_example_inputs(example_inputs)
        dispatcher_of(tm).compiled_for(tm, inputs, dict(example_kwargs or {}))
    return tm


def _as_plan(plan: Any) -> Optional[Plan]:
    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, Mapping):
        try:
            return Plan.from_dict(dict(plan))
        except (TypeError, KeyError) as e:
            raise ConfigError(
                f"plan is not a saved fxckpt plan ({e}); pass fxckpt.inspect(tm).plan or its "
                "to_dict()"
            ) from e
    raise ConfigError(f"plan must be a fxckpt.Plan or its to_dict() (got {type(plan).__name__})")


def _as_tuple(value: Any, name: str) -> tuple:
    if isinstance(value, (str, torch.device, int)) or not hasattr(value, "__iter__"):
        raise ConfigError(f"{name} must be a list (got {value!r}); e.g. {name}=['cpu', 'cpu']")
    return tuple(str(v) if isinstance(v, torch.device) else v for v in value)
