"""Captures shared by every transform of one model object.

Captures do not depend on fxckpt's options, so transforms of the same model (comparing
strategies in a notebook, say) share them, as long as the model still holds the same modules,
parameters and buffers (its :func:`fingerprint`); at most ``limit`` per model are offered.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Optional

import torch

from fxckpt.signature import CallKey, Shapes

if TYPE_CHECKING:
    from fxckpt.capture.captured import Captured

__all__ = ["Fingerprint", "fingerprint", "offer", "shared_capture"]

log = logging.getLogger(__name__)

Fingerprint = tuple[int, ...]
_SHARED: (
    "weakref.WeakKeyDictionary[torch.nn.Module, dict[CallKey, list[tuple[Fingerprint, Captured]]]]"
) = weakref.WeakKeyDictionary()
"""Captures per model object, shared by every transform of it."""


def fingerprint(tm: torch.nn.Module) -> Fingerprint:
    """Identities of every submodule, parameter and buffer: a capture holds references to them."""
    return (
        tuple(id(m) for name, m in tm.named_modules() if name)
        + tuple(id(p) for p in tm.parameters())
        + tuple(id(b) for b in tm.buffers())
    )


def shared_capture(model: torch.nn.Module, key: CallKey, shapes: Shapes, seen: Fingerprint,
                   method: str) -> Optional[Captured]:
    """A capture another transform of ``model`` made for such calls, if still valid."""
    for made, captured in _SHARED.get(model, {}).get(key, []):
        if (made == seen and captured.accepts(shapes) and method in ("auto", captured.method)
                and captured.guards.failure() is None):
            log.debug("reusing a capture made by another transform of %s", type(model).__name__)
            return captured
    return None


def offer(model: torch.nn.Module, key: CallKey, seen: Fingerprint, captured: Captured,
          limit: int) -> None:
    """Offer a capture to other transforms of ``model``; the oldest beyond ``limit`` (over all
    call keys) is no longer offered."""
    shared = _SHARED.setdefault(model, {})
    shared.setdefault(key, []).append((seen, captured))
    while sum(len(v) for v in shared.values()) > limit:
        oldest = next(k for k, v in shared.items() if v)
        shared[oldest].pop(0)
        if not shared[oldest]:
            del shared[oldest]
