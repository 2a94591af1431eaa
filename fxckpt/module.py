"""The module ``fxckpt.transform`` returns: the model itself, with a rewritten training forward.

``fxckpt.transform(model)`` returns an instance of a class derived from both
:class:`TransformedModule` and the model's own class, holding the same state as the model (a
shallow copy of its ``__dict__``: the same children, parameters, buffers, hooks and attributes).
So the transformed module *is* the model as far as anyone can tell:

* ``tm.config``, ``tm.generate(...)``, ``tm.get_input_embeddings()``, ``isinstance(tm,
  GPT2LMHeadModel)``: the model's attributes and methods, unchanged;
* ``tm.state_dict()`` has the model's keys, and an optimizer built on either trains both;
* no name of fxckpt's can collide with the model's: fxckpt adds no attribute but one dunder
  slot, ``__fxckpt__``. Its plans, code and stages are read through :func:`fxckpt.inspect`.

Only ``forward`` differs, and only in training: with ``self.training`` and grad enabled it runs
the rewritten graph chosen by :class:`~fxckpt.dispatch.Dispatcher`; in ``eval()`` or under
``torch.no_grad()`` (without pipeline stages) it runs the model's own forward — no capture, no
planning, no overhead.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from fxckpt.config import TransformConfig
from fxckpt.dispatch import Dispatcher

__all__ = ["TransformedModule", "make_transformed", "dispatcher_of", "STATE"]

log = logging.getLogger(__name__)

STATE = "__fxckpt__"
"""The one instance attribute fxckpt adds (a dunder name, so no model uses it)."""

_CLASSES: dict[type, type] = {}


class TransformedModule(torch.nn.Module):
    """Base of every module :func:`fxckpt.transform` returns (see the module docstring)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        dispatcher = dispatcher_of(self)
        if dispatcher.runs_model_itself(self.training):
            return super().forward(*args, **kwargs)  # the model's own forward, on the same state
        return dispatcher(self, args, kwargs)

    def train(self, mode: bool = True) -> "TransformedModule":
        super().train(mode)
        dispatcher_of(
            self
        ).model.training = mode  # the model's root flag follows, as its children do
        return self

    def _apply(self, fn: Callable, recurse: bool = True) -> "TransformedModule":
        # Captured graphs keep references to tensors that .to() / .half() replace: capture again.
        dispatcher_of(self).forget()
        return super()._apply(fn, recurse)

    def _get_name(self) -> str:
        return "fxckpt." + super()._get_name()

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickle and deepcopy rebuild from the model and the options; plans are made again lazily.
        dispatcher = dispatcher_of(self)
        return (_restore, (dispatcher.model, dispatcher.config, self.training))


def make_transformed(model: torch.nn.Module, config: TransformConfig) -> TransformedModule:
    """A new transformed module sharing ``model``'s state (``model`` itself is not changed)."""
    cls = _class_for(type(model))
    tm: TransformedModule = object.__new__(
        cls
    )  # FSDPModule.__new__ would build a fresh model instance
    tm.__dict__.update(model.__dict__)
    tm.__dict__.pop(STATE, None)
    if (
        tm.__dict__.get("_compiled_call_impl") is not None
    ):  # model.compile(): would skip our forward
        log.warning(
            "fxckpt: %s was compiled with module.compile(); the transformed module runs "
            "uncompiled (compile it after transforming: tm.compile())",
            type(model).__name__,
        )
        tm.__dict__["_compiled_call_impl"] = None
    tm.__dict__[STATE] = Dispatcher(model, config)
    return tm


def dispatcher_of(tm: torch.nn.Module) -> Dispatcher:
    """The :class:`Dispatcher` behind a transformed module."""
    return tm.__dict__[STATE]


def _class_for(model_cls: type) -> type:
    """``TransformedModule`` + the model's class, made once per model class."""
    cls = _CLASSES.get(model_cls)
    if cls is None:
        if issubclass(model_cls, TransformedModule):
            return model_cls
        cls = type(model_cls.__name__, (TransformedModule, model_cls), {
            "__module__": model_cls.__module__,
            "__qualname__": model_cls.__qualname__,
            "__doc__": model_cls.__doc__,
        })
        _CLASSES[model_cls] = cls
    return cls


def _restore(model: torch.nn.Module, config: TransformConfig, training: bool) -> TransformedModule:
    tm = make_transformed(model, config)
    tm.training = training
    return tm
