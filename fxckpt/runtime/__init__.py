"""Runtime machinery the rewritten graphs call. It never imports :mod:`fxckpt.passes`."""

from fxckpt.runtime.checkpoint import checkpoint, is_recomputing
from fxckpt.runtime.offload import HostPool, Offloader, OffloadStats, offload_region

__all__ = [
    "checkpoint",
    "is_recomputing",
    "Offloader",
    "OffloadStats",
    "HostPool",
    "offload_region",
]
