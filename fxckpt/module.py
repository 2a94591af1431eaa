"""The module ``fxckpt.transform`` returns.

It *is* the model, as far as state goes: the model's children, parameters and buffers are
registered on it under their own names, so ``tm.state_dict()`` has the original keys and an
optimizer built on either module trains both. Its ``forward`` runs a rewritten graph chosen by
input signature and mode; a signature not seen before is planned on the spot and cached.
Changing device or dtype (``tm.to(...)``) drops the cache, because captured graphs hold their
own references to buffers.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Hashable, Optional

import torch

from fxckpt.config import TransformConfig
from fxckpt.errors import NotPlannedError
from fxckpt.plan import Plan
from fxckpt.signature import signature_key

__all__ = ["TransformedModule"]

log = logging.getLogger(__name__)

MAX_CACHED_SIGNATURES = 16


class TransformedModule(torch.nn.Module):
    """A model rewritten by fxckpt; see :func:`fxckpt.transform`."""

    def __init__(self, model: torch.nn.Module, config: TransformConfig, build: Callable) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, p in model.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in model.named_buffers(recurse=False):
            self.register_buffer(name, b, persistent=name not in model._non_persistent_buffers_set)
        self.training = model.training
        # Not registered as submodules: they must not show up in state_dict() or parameters().
        self.__dict__["_model"] = model
        self.__dict__["_build"] = build
        self.__dict__["_compiled"] = {}
        self.__dict__["_last"] = None
        self.config = config
        self.__dict__["_offloader"] = _make_offloader(config)

    @property
    def model(self) -> torch.nn.Module:
        """The original model (shares every parameter and buffer with this module)."""
        return self.__dict__["_model"]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        compiled = self._compiled_for(args, kwargs)
        self.__dict__["_last"] = compiled
        offloader = self.__dict__["_offloader"]
        if offloader is None or not (self.training and torch.is_grad_enabled()):
            return compiled(args, kwargs)
        offloader.stats = type(offloader.stats)()
        if self.config.offload == "auto":
            return compiled(args, kwargs)
        with offloader.hooks(self):
            return compiled(args, kwargs)

    @property
    def offload_stats(self) -> Any:
        """What the latest training step offloaded (``None`` without ``offload=``)."""
        offloader = self.__dict__["_offloader"]
        return None if offloader is None else offloader.stats

    def plan_for(self, *args: Any, **kwargs: Any) -> Plan:
        """Plan (if needed) for these inputs without running a step, and return the plan."""
        compiled = self._compiled_for(args, kwargs)
        self.__dict__["_last"] = compiled
        return compiled.plan

    def _compiled_for(self, args: tuple, kwargs: dict) -> Any:
        key: Hashable = signature_key(self.training, args, kwargs)
        cache = self.__dict__["_compiled"]
        compiled = cache.get(key)
        if compiled is None:
            if len(cache) >= MAX_CACHED_SIGNATURES:
                log.warning("fxckpt: %d input signatures planned; dropping the oldest (are shapes changing "
                            "every step?)", len(cache))
                cache.pop(next(iter(cache)))
            self.model.train(self.training)
            compiled = cache[key] = self.__dict__["_build"](self.model, self.config, args, kwargs)
            _attach_offloader(compiled, self.__dict__["_offloader"])
        return compiled

    def _current(self) -> Any:
        compiled = self.__dict__["_last"]
        if compiled is None:
            raise NotPlannedError(
                "this module has not planned yet: it plans at its first call; call it once, or pass "
                "example_inputs= to fxckpt.transform, or use tm.plan_for(*inputs)"
            )
        return compiled

    @property
    def plan(self) -> Plan:
        """The plan used by the latest call (or made at transform time)."""
        return self._current().plan

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """The rewritten GraphModule used by the latest call."""
        return self._current().gm

    @property
    def pipeline(self) -> Optional[torch.nn.Module]:
        """The pipelined runner of the latest call (``None`` without stages): ``.recomputed``,
        ``.stage_modules``, ``.describe()``."""
        return self._current().pipeline

    @property
    def code(self) -> str:
        """Python code of the rewritten graph (segments appear as ``fxckpt_checkpoint(...)`` calls)."""
        return self.graph_module.code

    def train(self, mode: bool = True) -> "TransformedModule":
        super().train(mode)
        self.model.train(mode)
        return self

    def _apply(self, fn: Callable, recurse: bool = True) -> "TransformedModule":
        # Captured graphs keep references to buffers that .to()/.half() replace: plan again.
        self.__dict__["_compiled"].clear()
        self.__dict__["_last"] = None
        super()._apply(fn, recurse)
        model = self.model  # its own direct tensors may have been replaced on this module only
        for name in model._parameters:
            model._parameters[name] = self._parameters[name]
        for name in model._buffers:
            model._buffers[name] = self._buffers[name]
        return self

    def extra_repr(self) -> str:
        return f"strategy={self.config.strategy}, options={self.config.to_dict()}"


def _make_offloader(config: TransformConfig) -> Any:
    if not config.offload:
        return None
    from fxckpt.runtime.offload import Offloader

    return Offloader(config.offload_device or "cpu", threshold=config.offload_threshold)


def _attach_offloader(compiled: Any, offloader: Any) -> None:
    """Segments the plan offloads run their forward under this module's offloader."""
    for seg in compiled.plan.segments:
        if seg.action == "offload":
            compiled.gm.get_submodule(seg.name)._fxckpt_offloader = offloader
