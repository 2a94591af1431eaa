"""The options of :func:`fxckpt.transform`, checked once at the edge.

``transform`` turns its keyword arguments into one frozen :class:`TransformConfig`. Every check
on user input happens in :func:`TransformConfig.validate` so the passes can trust what they
receive, and so a bad value fails at ``transform`` time rather than in the middle of a step.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Literal, Mapping, Optional, Union

import torch

from fxckpt.budget import Budget
from fxckpt.errors import ConfigError

__all__ = ["TransformConfig", "FORCE_MODES"]

FORCE_MODES = ("recompute", "save")
ForceMode = Literal["recompute", "save"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformConfig:
    """What :func:`fxckpt.transform` was asked to do."""

    every: Optional[int] = None
    """Checkpoint segments of this many units of work (matmul/conv nodes); ``None`` = off."""

    depth: Optional[int] = None
    """Make each module at this nesting depth a segment (children of the model are depth 1)."""

    force: Mapping[str, ForceMode] = dataclasses.field(default_factory=dict)
    """Module paths pinned to ``"recompute"`` (own segment) or ``"save"`` (never recomputed)."""

    budget: Optional[Budget] = None
    """Bound on the peak activation memory of a training step; the solver picks segments."""

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

    replay: Optional[Any] = None
    """A saved :class:`~fxckpt.plan.Plan` whose segments are used as they are (no solving)."""

    offload: Union[bool, str] = False
    """``True``: saved tensors go to host memory in forward; ``"auto"``: the budget solver's
    segments each either recompute or offload, whichever the cost model says is cheaper."""

    offload_device: Optional[str] = None
    """Where offloaded tensors go; default ``"cpu"`` when CUDA is present (required without it)."""

    offload_threshold: int = 1 << 20
    """Saved tensors whose storage is smaller than this many bytes stay where they are."""

    offload_bandwidth: Optional[float] = None
    """Copy bandwidth in bytes/s for ``offload="auto"``; measured when not given."""

    @property
    def pipelined(self) -> bool:
        """True when the module runs as a pipeline of stages and micro-batches."""
        return any(v is not None for v in (self.chunks, self.devices, self.stages, self.balance))

    @property
    def strategy(self) -> str:
        """The name of the chosen strategy: ``every``, ``depth``, ``force`` or ``none``."""
        if self.every is not None:
            return "every"
        if self.depth is not None:
            return "depth"
        if self.budget is not None:
            return "budget"
        if self.replay is not None:
            return "replay"
        return "force" if self.force else "none"

    def to_dict(self) -> dict[str, Any]:
        budget = None if self.budget is None else dataclasses.asdict(self.budget)
        out: dict[str, Any] = {"every": self.every, "depth": self.depth, "force": dict(self.force), "budget": budget}
        if self.offload:
            out.update(offload=self.offload, offload_device=self.offload_device,
                       offload_threshold=self.offload_threshold, offload_bandwidth=self.offload_bandwidth)
        if self.pipelined:
            out.update(chunks=self.chunks, devices=list(self.devices or ()), checkpoint=self.checkpoint,
                       stages=self.stages, balance=None if self.balance is None else list(self.balance))
        return out

    def __post_init__(self) -> None:
        # Freeze a private copy of force once it is known to be a mapping (validate checks that).
        if isinstance(self.force, Mapping):
            object.__setattr__(self, "force", dict(self.force))

    def validate(self, model: torch.nn.Module) -> "TransformConfig":
        """Check every option against ``model``; raise :class:`ConfigError` on the first bad one."""
        given = {k: v for k, v in (("every", self.every), ("depth", self.depth),
                                   ("budget", self.budget), ("plan", self.replay)) if v is not None}
        if len(given) > 1:
            shown = " and ".join(f"{k}={_show(v)}" for k, v in given.items())
            raise ConfigError(f"give at most one strategy, got {shown}; choose one of them")
        if self.every is not None:
            _check_positive_int("every", self.every)
        if self.depth is not None:
            _check_positive_int("depth", self.depth)
            deepest = max(model.named_modules(), key=lambda kv: _depth(kv[0]))[0]
            if _depth(deepest) < self.depth:
                raise ConfigError(
                    f"depth={self.depth} is deeper than the model: its deepest module "
                    f"{deepest or '<root>'!r} has depth {_depth(deepest)}; use depth <= "
                    f"{max(_depth(deepest), 1)}"
                )
        _check_force(self.force, model)
        if self.pipelined:
            _check_pipeline(self)
        _check_offload(self)
        return self


def _show(value: object) -> str:
    if isinstance(value, Budget):
        return str(value)
    return "<Plan>" if type(value).__name__ == "Plan" else repr(value)


def _depth(path: str) -> int:
    return 0 if path == "" else path.count(".") + 1


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer (got {value!r})")


def _check_force(force: object, model: torch.nn.Module) -> None:
    if not isinstance(force, Mapping):
        raise ConfigError(
            f"force must be a dict of module path -> 'recompute' | 'save' (got {type(force).__name__})"
        )
    paths = [name for name, _ in model.named_modules() if name]
    for path, mode in force.items():
        if mode not in FORCE_MODES:
            raise ConfigError(
                f"force[{path!r}] must be one of {FORCE_MODES} (got {mode!r})"
            )
        if path not in paths:
            close = difflib.get_close_matches(str(path), paths, n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ConfigError(
                f"force names module {path!r}, which the model does not have{hint} "
                "(paths are as in model.named_modules())"
            )


def _check_pipeline(config: TransformConfig) -> None:
    from fxckpt.runtime.pipeline import check_checkpoint, check_chunks, check_device

    check_chunks(1 if config.chunks is None else config.chunks)
    check_checkpoint(config.checkpoint)
    if config.devices is not None:
        if isinstance(config.devices, (str, torch.device)) or not config.devices:
            raise ConfigError(f"devices must be a non-empty list, one device per stage (got {config.devices!r})")
        for d in config.devices:
            check_device(d)
    if config.stages is not None:
        _check_positive_int("stages", config.stages)
    if config.balance is not None and (isinstance(config.balance, (str, int)) or not config.balance):
        raise ConfigError(f"balance must be a list of node counts or module paths (got {config.balance!r})")


def _check_offload(config: TransformConfig) -> None:
    if config.offload not in (False, True, "auto"):
        raise ConfigError(f"offload must be True, False or 'auto' (got {config.offload!r})")
    if config.offload == "auto" and config.budget is None:
        raise ConfigError("offload='auto' lets the budget solver choose between recompute and offload; "
                          "give budget= too (got budget=None), or use offload=True")
    t = config.offload_threshold
    if isinstance(t, bool) or not isinstance(t, int) or t < 0:
        raise ConfigError(f"offload_threshold must be a non-negative number of bytes (got {t!r})")
    bw = config.offload_bandwidth
    if bw is not None and (isinstance(bw, bool) or not isinstance(bw, (int, float)) or not bw > 0):
        raise ConfigError(f"offload_bandwidth must be a positive number of bytes/s (got {bw!r})")
    if config.offload and config.offload_device is None and not torch.cuda.is_available():
        raise ConfigError(
            "offload moves saved tensors from a GPU to host memory, and this machine has no CUDA device; "
            "pass offload_device='cpu' to run the offload machinery on CPU anyway (as the tests do)"
        )
    if config.offload_device is not None:
        from fxckpt.runtime.pipeline import check_device

        check_device(config.offload_device)
