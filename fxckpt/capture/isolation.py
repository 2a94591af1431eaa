"""A capture is invisible to other threads.

Capturing runs the model's forward under tools that change process-wide state while they work:

* ``torch.fx``'s tracer (and ``torch.export``, which traces with it) replaces
  ``nn.Module.__call__`` and ``nn.Module.__getattr__`` for every module of the process, and the
  functions registered with ``torch.fx.wrap``; an untransformed model training in another thread
  would then run the tracer's code: a ``NameError`` ("module is not installed as a submodule"),
  or ``torch.fx.Proxy`` outputs and nothing trained;
* fxckpt itself notes custom autograd Function calls (``Function.apply``), module calls (global
  module hooks, under export) and numpy / ``random`` draws while it captures.

So captures run one at a time (:data:`CAPTURE_LOCK`), and every such replacement acts on the
capturing thread only: :func:`on_thread` makes a replacement that calls the original on any
other thread, and :func:`isolated` hands ``torch.fx`` a patcher whose patches are made that way.
Everything is put back when the capture ends.

What another thread can still see while a capture runs (documented in the guide):
``torch.fx._symbolic_trace.is_fx_tracing()`` is true process-wide, which only turns off the
inference fast path of ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` in ``eval()``
(the slow path computes the same function). Capture at ``transform`` time with
``example_inputs=`` to have no capture run while other threads work.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import threading
from typing import Any, Callable, Iterator

import torch.fx._symbolic_trace as fx_trace

__all__ = ["CAPTURE_LOCK", "on_thread", "isolated"]

CAPTURE_LOCK = threading.RLock()
"""Held while a capture runs: one capture at a time in the process."""


def on_thread(replacement: Callable[..., Any], original: Callable[..., Any],
              thread: int) -> Callable[..., Any]:
    """``replacement`` on thread ``thread``, ``original`` on every other thread."""
    @functools.wraps(replacement)
    def call(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == thread:
            return replacement(*args, **kwargs)
        return original(*args, **kwargs)

    return call


class _ThreadPatcher(fx_trace._Patcher):
    """torch.fx's patcher, with patches that act on the thread that made them only."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def patch(self, frame_dict: dict[str, Any], name: str, new_fn: Callable[..., Any],
              deduplicate: bool = True) -> None:
        original = frame_dict[name] if name in frame_dict else getattr(builtins, name, None)
        if original is None or getattr(original, "__fx_already_patched", False):
            super().patch(frame_dict, name, new_fn, deduplicate)
            return
        super().patch(frame_dict, name, on_thread(new_fn, original, self.thread), deduplicate)

    def patch_method(self, cls: type, name: str, new_fn: Callable[..., Any],
                     deduplicate: bool = True) -> None:
        original = getattr(cls, name)
        if getattr(original, "__fx_already_patched", False):
            super().patch_method(cls, name, new_fn, deduplicate)
            return
        super().patch_method(cls, name, on_thread(new_fn, original, self.thread), deduplicate)


@contextlib.contextmanager
def _thread_patcher() -> Iterator[fx_trace._Patcher]:
    """``torch.fx._symbolic_trace._new_patcher``, making a :class:`_ThreadPatcher`."""
    prior = fx_trace.CURRENT_PATCHER
    patcher = _ThreadPatcher()
    try:
        fx_trace.CURRENT_PATCHER = patcher
        yield patcher
    finally:
        patcher.revert_all_patches()
        fx_trace.CURRENT_PATCHER = prior


@contextlib.contextmanager
def isolated() -> Iterator[None]:
    """Run a capture: alone in the process, with torch.fx's patches on this thread only."""
    with CAPTURE_LOCK:
        original = fx_trace._new_patcher
        fx_trace._new_patcher = _thread_patcher  # type: ignore[assignment]
        try:
            yield
        finally:
            fx_trace._new_patcher = original
