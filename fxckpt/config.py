"""The options of :func:`fxckpt.transform`, checked once at the edge.

``transform`` turns its keyword arguments into one frozen :class:`TransformConfig`. Every check
on user input happens in :func:`TransformConfig.validate` so the passes can trust what they
receive, and so a bad value fails at ``transform`` time rather than in the middle of a step.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, Literal, Mapping, Optional, Union

import torch

from fxckpt.budget import Budget
from fxckpt.checks import check_int, check_number
from fxckpt.errors import ConfigError, dynamo_needs_whole_graph
from fxckpt.strategy import Budgeted, Depth, Every, Strategy, strategy_from

__all__ = ["TransformConfig", "FORCE_MODES", "CAPTURES"]

FORCE_MODES = ("recompute", "save")
CAPTURES = ("auto", "dynamo", "graph", "symbolic_trace", "export")
"""How :func:`fxckpt.transform` may capture the model. ``auto``: training calls through
TorchDynamo (:mod:`fxckpt.serve.dynamo`), one whole graph where a feature needs one (see
:attr:`TransformConfig.whole_graph_needed`); ``dynamo``: training calls through Dynamo only;
``graph``: one whole graph per call structure (``symbolic_trace``, else ``export``), or only
one of those two methods."""
ForceMode = Literal["recompute", "save"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformConfig:
    """What :func:`fxckpt.transform` was asked to do."""

    strategy: Optional[Strategy] = None
    """How segments are chosen (:mod:`fxckpt.strategy`); ``None``: only ``force`` pins, if any."""

    force: Mapping[str, ForceMode] = dataclasses.field(default_factory=dict)
    """Module paths pinned to ``"recompute"`` (own segment) or ``"save"`` (never recomputed)."""

    chunks: Optional[int] = None
    """Micro-batches per call for a pipeline; ``None`` = no pipeline (unless devices are given)."""

    devices: Optional[tuple[str, ...]] = None
    """One device per pipeline stage (``["cuda:0", "cuda:1"]``, ``["cpu", "cpu"]``)."""

    checkpoint: str = "except_last"
    """Per micro-batch stage recompute: ``always``, ``except_last`` or ``never`` (torchgpipe)."""

    stages: Optional[int] = None
    """Number of pipeline stages; default one per device."""

    balance: Optional[tuple] = None
    """Explicit stage sizes: node counts, or the module paths where stages 1..K-1 begin."""

    offload: Union[bool, str] = False
    """``True``: saved tensors go to host memory in forward; ``"auto"``: the budget solver's
    segments each either recompute or offload, whichever the cost model says is cheaper."""

    offload_device: Optional[str] = None
    """Where offloaded tensors go; default ``"cpu"`` when CUDA is present (required without it)."""

    offload_threshold: int = 1 << 20
    """Saved tensors whose storage is smaller than this many bytes stay where they are."""

    offload_bandwidth: Optional[float] = None
    """Copy bandwidth in bytes/s for ``offload="auto"``; measured when not given."""

    loss_fn: Optional[Callable[..., torch.Tensor]] = None
    """``loss_fn(output, *args, **kwargs)``: the loss verification runs (its saved tensors count
    toward the peak); ``None``: a stand-in that makes a full-size gradient per output."""

    verify: Optional[bool] = None
    """Run each training plan on fake tensors to verify its peak (:mod:`fxckpt.measure.verify`);
    ``None`` (default): every training plan, whatever strategy made it (budget plans are also
    tightened until the verified peak fits); ``False``: the simulator's figures only."""

    selective: bool = True
    """Budget plans may keep costly outputs inside segments (:mod:`fxckpt.solver.selective`)."""

    capture: str = "auto"
    """How the model is captured (see :data:`CAPTURES`): ``auto`` trains through TorchDynamo,
    each of its graphs planned (:mod:`fxckpt.serve.dynamo`), unless a feature needs one whole
    graph."""

    device_profile: Optional[str] = None
    """The device plans are priced for (``h100``, ``h200``, ``a100``, ``cpu``:
    :mod:`fxckpt.cost.devices`); ``None``: the model's own (measured on a GPU)."""

    @property
    def whole_graph_needed(self) -> str:
        """The first option asked for that needs one whole graph of the model (pipeline
        stages, a replayed plan, ``offload="auto"``, ``loss_fn=``: Dynamo's graphs end where
        it breaks the forward, not at the model's output), in words, or ``""``."""
        for what, asked in (("pipeline stages (chunks=, devices=)", self.pipelined),
                            ("a replayed plan (plan=)", type(self.strategy).__name__ == "Replay"),
                            ("offload='auto'", self.offload == "auto"),
                            ("loss_fn= (the loss a plan is verified with, applied to the "
                             "model's output)", self.loss_fn is not None)):
            if asked:
                return what
        return ""

    @property
    def graph_method(self) -> str:
        """How a whole graph is captured: ``symbolic_trace`` or ``export`` when asked for,
        else ``auto`` (symbolic_trace, else export)."""
        return self.capture if self.capture in ("symbolic_trace", "export") else "auto"

    @property
    def verifies(self) -> bool:
        """Are training plans of this config verified (never pipelined ones)?"""
        wanted = self.verify is not False
        return wanted and not self.pipelined

    @classmethod
    def from_options(
        cls,
        *,
        every: Any = None,
        depth: Any = None,
        budget: Any = None,
        plan: Any = None,
        **options: Any,
    ) -> "TransformConfig":
        """The config :func:`fxckpt.transform` builds from its keywords (not yet validated
        against a model): ``budget`` as users write it, ``plan`` a Plan."""
        from fxckpt.budget import parse_budget

        strategy = strategy_from(every=every, depth=depth, plan=plan,
                                 budget=None if budget is None else parse_budget(budget))
        return cls(strategy=strategy, **options)

    @property
    def pipelined(self) -> bool:
        """True when the module runs as a pipeline of stages and micro-batches."""
        return any(v is not None for v in (self.chunks, self.devices, self.stages, self.balance))

    @property
    def strategy_name(self) -> str:
        """``every``, ``depth``, ``budget``, ``replay``, ``force`` (pins only) or ``none``."""
        if self.strategy is not None:
            return self.strategy.name
        return "force" if self.force else "none"

    @property
    def budget(self) -> Optional[Budget]:
        """The budget of a ``budget=`` strategy (plans then depend on input sizes)."""
        return self.strategy.budget if isinstance(self.strategy, Budgeted) else None

    def to_dict(self) -> dict[str, Any]:
        s = self.strategy
        out: dict[str, Any] = {
            "every": s.units if isinstance(s, Every) else None,
            "depth": s.depth if isinstance(s, Depth) else None,
            "force": dict(self.force),
            "budget": None if self.budget is None else dataclasses.asdict(self.budget),
        }
        if not self.selective:
            out["selective"] = False
        if self.capture != "auto":
            out["capture"] = self.capture
        if self.device_profile is not None:
            out["device_profile"] = self.device_profile
        if self.offload:
            out.update(
                offload=self.offload,
                offload_device=self.offload_device,
                offload_threshold=self.offload_threshold,
                offload_bandwidth=self.offload_bandwidth,
            )
        if self.pipelined:
            out.update(
                chunks=self.chunks,
                devices=list(self.devices or ()),
                checkpoint=self.checkpoint,
                stages=self.stages,
                balance=None if self.balance is None else list(self.balance),
            )
        return out

    def __post_init__(self) -> None:
        # Freeze a private copy of force once it is known to be a mapping (validate checks that).
        if isinstance(self.force, Mapping):
            object.__setattr__(self, "force", dict(self.force))

    def validate(self, model: torch.nn.Module) -> "TransformConfig":
        """Check every option against ``model``; raise :class:`ConfigError` on the first bad one.
        """
        if isinstance(self.strategy, Depth):
            deepest = max(model.named_modules(), key=lambda kv: _depth(kv[0]))[0]
            if _depth(deepest) < self.strategy.depth:
                raise ConfigError(
                    f"depth={self.strategy.depth} is deeper than the model: its deepest module "
                    f"{deepest or '<root>'!r} has depth {_depth(deepest)}; use depth <= "
                    f"{max(_depth(deepest), 1)}"
                )
        _check_force(self.force, model)
        if not isinstance(self.selective, bool):
            raise ConfigError(f"selective must be True or False (got {self.selective!r})")
        if self.capture not in CAPTURES:
            raise ConfigError(
                f"capture must be one of {', '.join(map(repr, CAPTURES))} (got {self.capture!r})"
            )
        if self.device_profile is not None:
            from fxckpt.cost.devices import profile_for

            profile_for(self.device_profile, torch.device("cpu"))  # a known name
        _check_verify(self)
        if self.pipelined:
            _check_pipeline(self)
        _check_offload(self)
        if self.capture == "dynamo":
            _check_dynamo(self)
        return self


def _check_dynamo(config: TransformConfig) -> None:
    """What needs one whole graph of the model is not on the Dynamo path (yet)."""
    whole = config.whole_graph_needed
    if whole:
        raise ConfigError(dynamo_needs_whole_graph(f"{whole} needs one whole graph of the model"))


def _depth(path: str) -> int:
    return 0 if path == "" else path.count(".") + 1


def _check_force(force: object, model: torch.nn.Module) -> None:
    if not isinstance(force, Mapping):
        raise ConfigError(
            f"force must be a dict of module path -> 'recompute' | 'save' "
            f"(got {type(force).__name__})"
        )
    paths = [name for name, _ in model.named_modules() if name]
    for path, mode in force.items():
        if mode not in FORCE_MODES:
            raise ConfigError(
                f"force[{path!r}] must be one of {FORCE_MODES} (got {mode!r})"
            )
        if isinstance(path, str) and path.startswith("op:"):
            _check_op_pin(path)
        elif path not in paths:
            close = difflib.get_close_matches(str(path), paths, n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ConfigError(
                f"force names module {path!r}, which the model does not have{hint} "
                "(paths are as in model.named_modules())"
            )


def _check_op_pin(key: str) -> None:
    """``op:aten.mm`` or ``op:aten.mm.default``: an aten op (packet or overload) torch knows."""
    name = key[len("op:"):]
    parts = name.split(".")
    target: object = torch.ops
    try:
        if len(parts) not in (2, 3):
            raise AttributeError(name)
        for part in parts:
            target = getattr(target, part)
    except (AttributeError, RuntimeError):
        raise ConfigError(
            f"force[{key!r}] names no aten op; pin ops as 'op:<namespace>.<op>' or "
            "'op:<namespace>.<op>.<overload>', e.g. 'op:aten.mm' or 'op:aten.addmm.default'"
        ) from None


def _check_verify(config: TransformConfig) -> None:
    if config.verify not in (None, True, False):
        raise ConfigError(f"verify must be True, False or None (got {config.verify!r})")
    if config.loss_fn is not None and not callable(config.loss_fn):
        raise ConfigError(
            f"loss_fn must be a function loss_fn(output, *args, **kwargs) -> scalar tensor (got "
            f"{type(config.loss_fn).__name__})"
        )


def _check_pipeline(config: TransformConfig) -> None:
    from fxckpt.runtime.pipeline import check_checkpoint, check_chunks, check_devices

    check_chunks(1 if config.chunks is None else config.chunks)
    check_checkpoint(config.checkpoint)
    if config.devices is not None:
        check_devices(config.devices)
    if config.stages is not None:
        check_int("stages", config.stages)
    if config.balance is not None and (
        isinstance(config.balance, (str, int)) or not config.balance
    ):
        raise ConfigError(
            f"balance must be a list of node counts or module paths (got {config.balance!r})"
        )


def _check_offload(config: TransformConfig) -> None:
    if config.offload not in (False, True, "auto"):
        raise ConfigError(f"offload must be True, False or 'auto' (got {config.offload!r})")
    if config.offload == "auto" and config.budget is None:
        raise ConfigError(
            "offload='auto' lets the budget solver choose between recompute and offload; "
            "give budget= too (got budget=None), or use offload=True"
        )
    if config.offload_device is not None and not config.offload:
        raise ConfigError(
            f"offload_device={config.offload_device!r} was given without offload=; pass "
            "offload=True (or 'auto' with a budget) to move saved tensors there, or drop "
            "offload_device"
        )
    check_int("offload_threshold", config.offload_threshold, low=0, unit="of bytes")
    if config.offload_bandwidth is not None:
        check_number("offload_bandwidth", config.offload_bandwidth, strict=True, unit="of bytes/s")
    # A plan priced for a named GPU (a meta model planned here for an H100) may offload: the
    # host is the CPU, and nothing runs on this machine's devices.
    if config.offload and config.offload_device is None and not torch.cuda.is_available() \
            and config.device_profile in (None, "cpu"):
        raise ConfigError(
            "offload moves saved tensors from a GPU to host memory, and this machine has no CUDA "
            "device; pass offload_device='cpu' to run the offload machinery on CPU anyway (as the "
            "tests do), or device_profile= to plan for a GPU"
        )
    if config.offload_device is not None:
        from fxckpt.runtime.host_pool import host_device

        host_device(config.offload_device)
