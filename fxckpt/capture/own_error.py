"""What the model itself raises for a call that fxckpt could not capture or plan.

A call the model refuses (a missing argument, ``tm([x])``, its own ``ValueError`` on bad input)
must raise what the model raises, not fxckpt's error: the dispatcher asks :func:`own_error`
when capture or planning failed.
"""

from __future__ import annotations

import os
import traceback
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["own_error"]


def own_error(view: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[Exception]:
    """The exception the model's own forward raises for this call, if it raises one.

    Asked only when capture or planning failed: a call the model itself refuses (a missing
    argument, ``tm([x])``, its own ``ValueError`` on bad input) must raise what the model
    raises, not fxckpt's error. The forward runs under Traceless (buffers, attributes and
    hooks as they were), and is given up, with no answer, at its first in-place write to a
    parameter or buffer (an EMA teacher's update, which the guard would not put back) and for
    models FSDP shards (their forward needs FSDP's hooks and collectives on every rank).
    """
    from fxckpt.capture.sharding import sharding_key
    from fxckpt.capture.traceless import Traceless
    from fxckpt.signature import has_hooks

    if any(sharding_key(view)):
        return None
    hooked = [m for m in view.modules() if has_hooks(m)]
    try:
        with Traceless(view, hooked), _NoStateWrites([*view.parameters(), *view.buffers()]):
            type(view).forward(view, *args, **kwargs)
    except _GaveUp:
        return None
    except Exception as e:  # the model's own: whatever it is, it is the answer
        return None if _meta_limit(e) else e
    return None


def _meta_limit(error: Exception) -> bool:
    """The probe stopped at what a meta tensor cannot do (``.item()``, a data-dependent shape),
    not at the model's own refusal: a model planned on the meta device runs under tracing, where
    those calls are recorded, and its capture or planning error is the answer."""
    frames = traceback.extract_tb(error.__traceback__)
    return isinstance(error, (RuntimeError, NotImplementedError)) and (
        "meta tensor" in str(error) or bool(frames) and frames[-1].filename.endswith(
            f"torch{os.sep}_meta_registrations.py"))


class _GaveUp(Exception):
    """The probe of :func:`own_error` would have changed the model's state."""


class _NoStateWrites(TorchDispatchMode):
    """Raises :class:`_GaveUp` before any op writes one of ``state`` in place."""

    def __init__(self, state: list[torch.Tensor]) -> None:
        super().__init__()
        self.state = {t.untyped_storage().data_ptr() for t in state if t.numel()}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
                if isinstance(value, torch.Tensor) and \
                        value.untyped_storage().data_ptr() in self.state:
                    raise _GaveUp()
        return func(*args, **kwargs)
