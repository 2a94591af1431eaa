"""Runtime machinery the rewritten graphs call. It never imports :mod:`fxckpt.passes`."""

from fxckpt.runtime.checkpoint import checkpoint, is_recomputing

__all__ = ["checkpoint", "is_recomputing"]
