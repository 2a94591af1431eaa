"""Host memory for offloaded tensors: buffers reused across steps, and where they may live.

:class:`HostPool` hands out uint8 buffers on the offload device (pinned CPU memory when it can,
pageable when pinning fails) keyed by size, and takes them back with the CUDA event of their last
user, so a copy into a reused buffer waits for it. :func:`host_device` checks an
``offload_device``. :mod:`fxckpt.runtime.offload` copies saved tensors into these buffers.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional, Union

import torch

from fxckpt.errors import ConfigError
from fxckpt.runtime.pipeline import check_device

__all__ = ["HostPool", "host_device"]

log = logging.getLogger("fxckpt.runtime.offload")


class HostPool:
    """Buffers on ``device`` reused across steps, keyed by size; pinned when ``pin`` (CPU only)."""

    def __init__(self, pin: bool, device: Union[torch.device, str] = "cpu") -> None:
        self.device = torch.device(device)
        self.pin = pin and self.device.type == "cpu"
        self.free: dict[int, list[torch.Tensor]] = {}
        self.in_use: dict[int, torch.Tensor] = {}
        self.allocated_bytes = 0
        self.pageable_fallbacks = 0
        self._fences: dict[int, Any] = {}
        self._lock = threading.Lock()  # buffers come back from autograd's threads

    def take(self, nbytes: int) -> tuple[torch.Tensor, Optional[Any]]:
        """A uint8 buffer of ``nbytes`` (from the free list when one fits exactly), and the CUDA
        event its last user recorded (a copy into it must wait for it), or ``None``."""
        with self._lock:
            bucket = self.free.get(nbytes)
            buf = bucket.pop() if bucket else None
            fence = self._fences.pop(id(buf), None) if buf is not None else None
        if buf is None:
            buf = self._allocate(nbytes)
        with self._lock:
            self.in_use[id(buf)] = buf
        return buf, fence

    def give_back(self, buf: torch.Tensor, fence: Optional[Any] = None) -> None:
        with self._lock:
            self.in_use.pop(id(buf), None)
            if fence is not None:
                self._fences[id(buf)] = fence
            self.free.setdefault(buf.numel(), []).append(buf)

    @property
    def in_use_bytes(self) -> int:
        return sum(b.numel() for b in list(self.in_use.values()))

    def _allocate(self, nbytes: int) -> torch.Tensor:
        self.allocated_bytes += nbytes
        if self.pin:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as e:  # pinned memory exhausted: pageable still works, slower
                self.pageable_fallbacks += 1
                log.warning("fxckpt offload: pinned allocation of %d bytes failed (%s); using "
                            "pageable memory", nbytes, e)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)



def host_device(device: Union[torch.device, str]) -> torch.device:
    """``device`` as where offloaded tensors may live: the CPU or an existing CUDA device."""
    try:
        dev, why = torch.device(device), ""
    except (RuntimeError, TypeError, ValueError) as e:
        dev, why = None, f": {e}"
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"offload_device must be 'cpu' or a CUDA device like 'cuda:0' (got "
                          f"{device!r}{why}); offloaded tensors are copied there and back")
    return check_device(dev, "offload_device")
