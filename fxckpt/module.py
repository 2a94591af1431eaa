"""The module ``fxckpt.transform`` returns: the model itself, with a rewritten training forward.

``fxckpt.transform(model)`` returns an instance of a class derived from both
:class:`TransformedModule` and the model's own class, holding the model's state itself: its
``__dict__`` *is* the model's (the same children, parameters, buffers, hooks and attributes, and
an attribute set on either is set on both). So the transformed module *is* the model as far as
anyone can tell:

* ``tm.config``, ``tm.generate(...)``, ``tm.get_input_embeddings()``, ``isinstance(tm,
  GPT2LMHeadModel)``: the model's attributes and methods, unchanged;
* ``tm.state_dict()`` has the model's keys, and an optimizer built on either trains both;
* ``tm.temperature = 2.0`` is ``model.temperature = 2.0``, and ``model.eval()`` puts ``tm``
  in eval mode: there is one state;
* no name of fxckpt's can collide with the model's: fxckpt adds no attribute to that state; its
  own lives in one slot of the transformed module, ``__fxckpt__``, outside the shared
  ``__dict__``. Its plans, code and stages are read through :func:`fxckpt.inspect`.

Only ``forward`` differs, and only in training: with ``self.training`` and grad enabled it runs
the rewritten graph chosen by :class:`~fxckpt.serve.dispatch.Dispatcher`; in ``eval()`` or under
``torch.no_grad()`` (without pipeline stages) it runs the model's own forward — no capture, no
planning, no overhead.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch

from fxckpt.capture.sharding import share_state
from fxckpt.config import TransformConfig
from fxckpt.serve.dispatch import Dispatcher
from fxckpt import integrations

__all__ = ["TransformedModule", "make_transformed", "dispatcher_of", "is_transformed", "STATE"]

log = logging.getLogger(__name__)

STATE = "__fxckpt__"
"""The slot holding fxckpt's state (a dunder name outside the model's ``__dict__``)."""

_CLASSES: dict[type, type] = {}


class TransformedModule(torch.nn.Module):
    """Base of every module :func:`fxckpt.transform` returns (see the module docstring)."""

    __slots__ = ("__fxckpt__",)
    __fxckpt__: Dispatcher

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        dispatcher = dispatcher_of(self)
        if dispatcher.runs_model_itself(self.training):
            return super().forward(*args, **kwargs)  # the model's own forward, on the same state
        return dispatcher(self, args, kwargs)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``nn.Module.compile``: compile this module's call in place (kept in fxckpt's slot, not
        in the ``__dict__`` it shares with the model, whose own call stays as it is)."""
        dispatcher_of(self).compiled_call = torch.compile(self._call_impl, *args, **kwargs)

    def _wrapped_call_impl(self, *args: Any, **kwargs: Any) -> Any:
        # As nn.Module's, but with this module's compiled call: a `_compiled_call_impl` in the
        # shared __dict__ is the model's own (model.compile()), which would skip our forward.
        compiled = dispatcher_of(self).compiled_call
        if compiled is not None:
            return compiled(*args, **kwargs)
        return self._call_impl(*args, **kwargs)

    __call__ = _wrapped_call_impl

    def _apply(self, fn: Callable, recurse: bool = True) -> "TransformedModule":
        # Captured graphs keep references to tensors that .to() / .half() replace: capture again,
        # unless nothing moved (Lightning calls .to(device) as fit starts and .cpu() as it ends).
        before = _tensor_states(self)
        out = super()._apply(fn, recurse)
        if _tensor_states(self) != before:
            dispatcher_of(self).forget()
        return out

    def _get_name(self) -> str:
        return "fxckpt." + super()._get_name()

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickle and deepcopy rebuild from the model and the options; plans are made again lazily.
        dispatcher = dispatcher_of(self)
        return (_restore, (dispatcher.model, dispatcher.config, self.training))


def make_transformed(model: torch.nn.Module, config: TransformConfig) -> TransformedModule:
    """A new transformed module whose state is ``model``'s own ``__dict__`` (``model`` gains no
    attribute)."""
    cls = _class_for(type(model))
    # object.__new__, not cls(): FSDPModule.__new__ would build a fresh model instance.
    integrations.release_own_checkpointing(model)
    tm: TransformedModule = object.__new__(cls)
    object.__setattr__(tm, "__dict__", model.__dict__)
    object.__setattr__(tm, STATE, Dispatcher(model, config))
    share_state(model, tm)  # fully_shard applied before transform: tm.unshard() works too
    if model.__dict__.get("_compiled_call_impl") is not None:  # model.compile()
        log.warning(
            "fxckpt: %s was compiled with module.compile(); the transformed module runs "
            "uncompiled (compile it after transforming: tm.compile())",
            type(model).__name__,
        )
    return tm


def dispatcher_of(tm: torch.nn.Module) -> Dispatcher:
    """The :class:`Dispatcher` behind a transformed module."""
    return tm.__fxckpt__  # type: ignore[return-value]


def is_transformed(obj: object) -> bool:
    """True for a module :func:`fxckpt.transform` returned."""
    return isinstance(obj, TransformedModule)


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
            "forward": _forward_like(model_cls),
            **integrations.class_overrides(model_cls),
        })
        _CLASSES[model_cls] = cls
    return cls


def _tensor_states(module: torch.nn.Module) -> list[tuple]:
    """Identity, storage, dtype and device of every parameter and buffer (``_apply`` may
    replace a tensor, or its ``.data``, or neither)."""
    return [
        (id(t), t.data_ptr() if t.device.type != "meta" else 0, t.dtype, t.device)
        for t in (*module.parameters(), *module.buffers())
    ]


def _forward_like(model_cls: type) -> Callable[..., Any]:
    """:meth:`TransformedModule.forward` dressed as the model's: its signature, name, docstring
    and ``__wrapped__``, so frameworks that read ``inspect.signature(model.forward)`` (the
    Hugging Face Trainer's column filter, PEFT, Lightning, accelerate) see the model's."""

    def forward(self: TransformedModule, *args: Any, **kwargs: Any) -> Any:
        return TransformedModule.forward(self, *args, **kwargs)

    own = getattr(model_cls, "forward", None)
    if callable(own) and own is not torch.nn.Module.forward:
        functools.update_wrapper(forward, own)
    return forward


def _restore(model: torch.nn.Module, config: TransformConfig, training: bool) -> TransformedModule:
    tm = make_transformed(model, config)
    tm.training = training
    return tm
