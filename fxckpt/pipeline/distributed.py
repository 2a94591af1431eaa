"""Pipelines across processes: fxckpt stages as ``torch.distributed.pipelining`` stages.

When one host is not enough, the same stage GraphModules that :func:`fxckpt.pipeline.build.
build_pipeline` runs locally become one ``PipelineStage`` per rank, and torch's schedules drive
them (point-to-point sends between ranks instead of ``.to(device)``):

    rank 0: PipelineStage(stage 0) --send activations--> rank 1: PipelineStage(stage 1) --> loss_fn
            <------------------------ send gradients ------------------------

    GPipe   F0 F1 F2 F3 . . . B3 B2 B1 B0        all forwards, then all backwards
    1F1B    F0 F1 B0 F2 B1 F3 B2 B3              at most K micro-batches in flight per stage

Every rank transforms the same model the same way and calls ``build_stage(tm, rank, device)``.

Names. A stage graph keeps its parameters inside its checkpoint segments (``segment_0.0.weight``),
names no checkpoint or optimizer state of the model knows. The stage module the schedule runs
(:class:`StageModule`) registers the stage's parameters and buffers under the model's own names
instead (``0.weight``), so ``stage.submod.state_dict()`` is a part of ``model.state_dict()`` and
``torch.distributed.checkpoint`` saves a pipelined run that loads into the unmodified model.

A stage keeps its checkpoint plan: segments lowered into it still run through
``fxckpt.checkpoint``; ``recompute=True`` additionally checkpoints the whole stage per
micro-batch (``checkpoint="always"`` of the local pipeline), restoring the buffers it writes
so BatchNorm statistics are updated once per micro-batch, not again when it is recomputed
(no deferral across ranks: each micro-batch updates them, as a plain loop over micro-batches
would). Values sent between ranks must be tensors (``torch.distributed.pipelining`` sends
nothing else); :func:`build_stage` checks that and names any value that is not.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.fx
import torch.nn as nn

from fxckpt.checks import check_example_inputs, check_int
from fxckpt.errors import ConfigError, not_planned
from fxckpt.cost.annotate import has_info, info
from fxckpt.capture.tracer import ORIGINAL_PATH
from fxckpt.runtime.checkpoint import checkpoint as run_checkpointed
from fxckpt.runtime.pipeline import check_device
from fxckpt.runtime.segment import Recomputable, SegmentModule
from fxckpt.runtime.state import values_kept

__all__ = ["build_stage", "schedule", "stage_state", "StageModule", "SCHEDULES"]

SCHEDULES = ("gpipe", "1f1b")


class _Recomputed(Recomputable):
    """What ``recompute=True`` checkpoints: the stage graph, restoring every buffer it writes."""

    def __init__(self, module: nn.Module, index: int) -> None:
        super().__init__()
        self.module = module
        self.name = f"distributed stage {index}"
        self.restores = tuple(name for name, _ in self.named_buffers())

    def forward(self, *args: Any) -> Any:
        return self.module(*args)


class StageModule(nn.Module):
    """One stage as the schedule runs it: the stage graph, under the model's own names.

    The stage GraphModule is held, not registered: the module's parameters and buffers are the
    graph's own tensor objects, registered in a tree of plain modules under the model's names.
    """

    def __init__(self, graph: nn.Module, index: int, model: Optional[nn.Module] = None,
                 recompute: bool = False) -> None:
        super().__init__()
        self.index = index
        self.recompute = recompute
        self.__dict__["graph"] = graph
        self.__dict__["_model"] = model
        self.__dict__["_recomputed"] = _Recomputed(graph, index) if recompute else None
        self._link()

    def _link(self) -> None:
        self._modules.clear()
        self._parameters.clear()
        self._buffers.clear()
        state = stage_state(self.__dict__["graph"], self.__dict__["_model"])
        for name, (tensor, persistent) in state.items():
            _register(self, name, tensor, persistent)

    def forward(self, *args: Any) -> Any:
        recomputed = self.__dict__["_recomputed"]
        if recomputed is not None and self.training:
            return run_checkpointed(recomputed, *args)
        return self.__dict__["graph"](*args)

    def _apply(self, fn: Callable, recurse: bool = True) -> "StageModule":
        self.__dict__["graph"]._apply(fn, recurse)  # the graph's tensors, constants included
        self._link()
        return self

    def extra_repr(self) -> str:
        return f"stage={self.index}, recompute={self.recompute}"


def stage_state(graph: nn.Module,
                model: Optional[nn.Module] = None) -> dict[str, tuple[torch.Tensor, bool]]:
    """``{model name: (tensor, persistent)}`` for the parameters and buffers a stage graph reads.

    Names come from the graph (segment submodules dropped, renamed attributes restored). With
    ``model``, only the model's own tensors are kept, under the model's names and persistence;
    without it, every tensor the graph holds (constants of an exported graph included).
    """
    renamed = _renamed_heads(graph)
    found: dict[str, tuple[torch.Tensor, bool]] = {}
    for name, t in _tensors(graph):
        found.setdefault(_model_name(graph, name, renamed), (t, True))
    if model is None:
        return found
    own = dict(_tensors(model))
    by_id: dict[int, str] = {}
    for name, t in own.items():
        by_id.setdefault(id(t), name)
    kept: dict[str, tuple[torch.Tensor, bool]] = {}
    for name, (t, _) in found.items():
        if own.get(name) is not t:
            if id(t) not in by_id:
                continue  # not the model's (a constant of the graph)
            name = by_id[id(t)]
        kept[name] = (t, _persistent(model, name))
    return kept


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer under every name (shared ones under each)."""
    return [*module.named_parameters(remove_duplicate=False),
            *module.named_buffers(remove_duplicate=False)]


def _model_name(graph: nn.Module, name: str, renamed: dict[str, str]) -> str:
    head, _, rest = name.partition(".")
    child = graph._modules.get(head)
    if rest and isinstance(child, SegmentModule):
        return _model_name(child, rest, renamed)
    return renamed.get(head, head) + ("." + rest if rest else "")


def _renamed_heads(graph: nn.Module) -> dict[str, str]:
    """``{graph attribute: model attribute}`` for model attributes a GraphModule had to rename."""
    renamed: dict[str, str] = {}
    for m in graph.modules():
        if isinstance(m, torch.fx.GraphModule):
            for n in m.graph.nodes:
                if ORIGINAL_PATH in n.meta:
                    renamed[str(n.target).split(".")[0]] = str(n.meta[ORIGINAL_PATH]).split(".")[0]
    return renamed


def _persistent(model: nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    return leaf not in model.get_submodule(owner)._non_persistent_buffers_set


def _register(root: nn.Module, name: str, tensor: torch.Tensor, persistent: bool) -> None:
    *path, leaf = name.split(".")
    module = root
    for part in path:
        child = module._modules.get(part)
        if child is None:
            child = module._modules[part] = nn.Module()
        module = child
    if isinstance(tensor, nn.Parameter):
        module._parameters[leaf] = tensor
    else:
        module.register_buffer(leaf, tensor, persistent=persistent)


_INFERENCE = ("_forward_metadata_inference", "_shape_inference")
"""``PipelineStage`` methods that run the stage once on made-up inputs (torch 2.13, earlier)."""


@functools.lru_cache(maxsize=None)
def _pipeline_stage_class() -> type:
    """``PipelineStage``, except that its shape inference leaves the stage's buffers as they were.

    Torch infers each stage's output shapes by running its forward on uninitialised tensors
    of the micro-batch's shape: a training-mode BatchNorm would count that run and fold its
    statistics into ``running_mean``/``running_var``.
    """
    from torch.distributed.pipelining import PipelineStage

    methods = {name: _keeping_buffers(getattr(PipelineStage, name)) for name in _INFERENCE
               if hasattr(PipelineStage, name)}
    return type("PipelineStage", (PipelineStage,), {"__module__": __name__, **methods})


def _keeping_buffers(method: Callable) -> Callable:
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with values_kept(self.submod.buffers()):
            return method(self, *args, **kwargs)

    run.__name__ = method.__name__
    return run


def _stage_modules(stages: Any, example_inputs: Optional[Sequence[Any]],
                   example_kwargs: Optional[dict]) -> tuple[list[nn.Module], Optional[nn.Module]]:
    """The stage graphs, and the model whose names they take (``None`` when not known)."""
    from fxckpt.module import dispatcher_of, is_transformed

    if is_transformed(stages):
        return _stages_of(stages, dispatcher_of(stages), example_inputs, example_kwargs)
    if example_inputs is not None or example_kwargs is not None:
        raise ConfigError("example_inputs= plans a transformed module; the stages given are "
                          f"planned already (got {type(stages).__name__})")
    if hasattr(stages, "stage_modules"):
        return list(stages.stage_modules), None
    if (
        isinstance(stages, (list, tuple))
        and stages
        and all(isinstance(s, nn.Module) for s in stages)
    ):
        return list(stages), None
    raise ConfigError(
        "stages must be a module fxckpt.transform returned (with stages=, devices= or chunks=), "
        "its fxckpt.inspect(tm).pipeline, or a list of stage modules "
        f"(got {type(stages).__name__})"
    )


def _stages_of(tm: nn.Module, dispatcher: Any, example_inputs: Optional[Sequence[Any]],
               example_kwargs: Optional[dict]) -> tuple[list[nn.Module], nn.Module]:
    if not dispatcher.config.pipelined:
        raise ConfigError(
            f"this {type(dispatcher.model).__name__} was transformed without stages; transform it "
            "with stages=K (one per rank), e.g. fxckpt.transform(model, depth=2, stages=2, "
            "chunks=4)"
        )
    if example_inputs is not None or example_kwargs is not None:
        inputs = check_example_inputs(example_inputs)
        compiled = dispatcher.compiled_for(tm, inputs, dict(example_kwargs or {}))
    elif dispatcher.last is None:
        raise ConfigError(not_planned(
            "it has no stages to build",
            "pass example_inputs=(batch,) to build_stage (or to fxckpt.transform), or call it "
            "once in training"))
    else:
        compiled = dispatcher.last
    return list(compiled.pipeline.stage_modules), dispatcher.model


def _refuse_shared_parameters(modules: list[nn.Module], model: Optional[nn.Module]) -> None:
    """A parameter two stages use (tied embeddings) would be two copies on two ranks.

    Each rank would add only its own stage's part to the gradient and step its own copy, and the
    copies would drift apart: refused, rather than trained silently wrong.
    """
    users: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for j, m in enumerate(modules):
        for name, (t, _) in stage_state(m, model).items():
            if isinstance(t, nn.Parameter) and j not in users.setdefault(id(t), []):
                users[id(t)].append(j)
                names.setdefault(id(t), name)
    shared = {names[i]: stages for i, stages in users.items() if len(stages) > 1}
    if shared:
        shown = ", ".join(f"{n} (stages {s})" for n, s in sorted(shared.items()))
        raise ConfigError(
            f"parameters used by more than one stage: {shown}. Each rank would keep its own copy "
            "and its own part of the gradient. Untie them (Hugging Face: "
            "config.tie_word_embeddings=False), or choose stage boundaries that keep their users "
            "in one stage (balance=)"
        )


def _check_tensor_edges(module: nn.Module, index: int, count: int) -> None:
    """Values crossing ranks must be tensors; the stage's annotations say which are not."""
    if not isinstance(module, torch.fx.GraphModule):
        return
    nodes = list(module.graph.nodes)
    edges = [n for n in nodes if n.op == "placeholder"] if index > 0 else []
    if index < count - 1:
        out = next(n for n in reversed(nodes) if n.op == "output")
        edges += [a for a in out.all_input_nodes]
    bad = [n.name for n in edges if has_info(n) and not info(n).is_tensor]
    if bad:
        raise ConfigError(
            f"stage {index} sends or receives non-tensor values {bad} between ranks, which "
            "torch.distributed.pipelining cannot carry; choose other stage boundaries (balance=)"
        )


def build_stage(
    stages: Union[nn.Module, Sequence[nn.Module], Any],
    stage_index: int,
    device: Union[str, torch.device],
    *,
    group: Optional[Any] = None,
    recompute: bool = False,
    example_inputs: Optional[Sequence[Any]] = None,
    example_kwargs: Optional[dict] = None,
) -> Any:
    """The ``PipelineStage`` of stage ``stage_index`` on ``device`` for this rank.

    ``stages`` is the module :func:`fxckpt.transform` returned with ``stages=`` (planned by a
    call, by ``example_inputs=`` given to ``transform``, or by the ``example_inputs=`` given here:
    a batch as the schedule's ``step`` gets it), ``fxckpt.inspect(tm).pipeline``, or a list of
    stage GraphModules. Every rank builds the same stages and keeps one. ``stage.submod`` holds
    the model's parameters under the model's names.
    """
    modules, model = _stage_modules(stages, example_inputs, example_kwargs)
    check_int("stage_index", stage_index, low=0, high=len(modules) - 1)
    dev = check_device(device)
    _refuse_shared_parameters(modules, model)
    graph = modules[stage_index]
    _check_tensor_edges(graph, stage_index, len(modules))
    module = StageModule(graph, stage_index, model, recompute).to(dev)
    return _pipeline_stage_class()(module, stage_index, len(modules), dev, group=group)


def schedule(stage: Any, kind: str, n_microbatches: int, loss_fn: Optional[Callable] = None,
             *, scale_grads: bool = True) -> Any:
    """A ``ScheduleGPipe`` (``"gpipe"``) or ``Schedule1F1B`` (``"1f1b"``) running ``stage``.

    ``loss_fn(output, target)`` is applied per micro-batch on the last rank. With
    ``scale_grads=True`` (torch's default) gradients are divided by ``n_microbatches``; pass
    ``False`` with a loss summed over the batch to get the full batch's gradient.
    """
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    if kind not in SCHEDULES:
        raise ConfigError(f"schedule kind must be one of {SCHEDULES} (got {kind!r})")
    check_int("n_microbatches", n_microbatches)
    cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
    return cls(stage, n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
