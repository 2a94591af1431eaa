"""Offload: move the tensors autograd keeps for backward to host memory during forward.

Recompute trades compute for memory; offload trades copy bandwidth for memory, and costs almost
nothing when the copies overlap compute. The mechanism is a pair of saved-tensor hooks that are
active around the forward pass. PyTorch calls the *innermost* hooks, so they see exactly the
tensors we want:

    forward, outside segments     our hooks are innermost   -> pack: copy to host
      (incl. segment inputs,       (checkpoint saves them
       saved before its hook)       outside its own hooks)
    forward, inside a segment     checkpoint's hooks         -> not ours: nothing is kept
    backward recompute            recomputation hooks        -> not ours: stays on device
    backward                      the packed handle          -> unpack: copy back

What is never offloaded: parameters, buffers and views of them (by storage identity, not type),
tensors smaller than ``threshold`` bytes. A view and its base share one host copy (the copy is of
the whole storage, so strides and offsets come back as they were, and an expanded stride-0
tensor is not materialised).

Host buffers come from a :class:`HostPool` reused across steps (pinned when CUDA is present, with
a pageable fallback when pinning fails). On CUDA, device-to-host copies run on a side stream that
first waits for the compute stream; ``record_stream`` keeps the allocator from reusing the
source early; in backward, the next tensor (in reverse pack order) is prefetched on a copy stream
while the current one is used.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["HostPool", "Offloader", "OffloadStats", "offload_region"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class OffloadStats:
    """What the latest training step moved."""

    packed: int = 0
    """Saved tensors handed to the offloader (offloaded or not)."""
    offloaded: int = 0
    """Saved tensors sent to host memory."""
    unpacked: int = 0
    """Offloaded tensors brought back in backward."""
    storages: int = 0
    """Distinct storages copied (a view and its base count once)."""
    bytes_moved: int = 0
    """Bytes copied device -> host (each storage once)."""
    skipped_small: int = 0
    skipped_state: int = 0
    copy_seconds: float = 0.0
    """Wall time spent issuing/doing copies (on CUDA, issuing only: they are asynchronous)."""


class HostPool:
    """Host buffers reused across steps, keyed by size; pinned when CUDA is available."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.free: dict[int, list[torch.Tensor]] = {}
        self.in_use: dict[int, torch.Tensor] = {}
        self.allocated_bytes = 0
        self.pageable_fallbacks = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer of ``nbytes`` (from the free list when one fits exactly)."""
        bucket = self.free.get(nbytes)
        buf = bucket.pop() if bucket else self._allocate(nbytes)
        self.in_use[id(buf)] = buf
        return buf

    def give_back(self, buf: torch.Tensor) -> None:
        self.in_use.pop(id(buf), None)
        self.free.setdefault(buf.numel(), []).append(buf)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        self.allocated_bytes += nbytes
        if self.pin:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as e:  # pinned memory exhausted: pageable still works, slower
                self.pageable_fallbacks += 1
                log.warning("fxckpt offload: pinned allocation of %d bytes failed (%s); using pageable memory",
                            nbytes, e)
        return torch.empty(nbytes, dtype=torch.uint8)


@dataclasses.dataclass
class _Stored:
    """One storage copied to host; shared by every saved view of it."""

    host: torch.Tensor
    device: torch.device
    nbytes: int
    refs: int = 0
    restored: Optional[torch.UntypedStorage] = None
    ready: Optional[Any] = None  # a CUDA event when a prefetch is in flight


@dataclasses.dataclass(frozen=True)
class _Handle:
    key: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    requires_grad: bool
    order: int


class Offloader:
    """Saved-tensor hooks that offload to ``device`` (see the module docstring)."""

    def __init__(self, device: torch.device | str = "cpu", threshold: int = 1 << 20) -> None:
        self.device = torch.device(device)
        self.threshold = threshold
        self.pool = HostPool(pin=torch.cuda.is_available() and self.device.type == "cpu")
        self.stats = OffloadStats()
        self._stored: dict[int, _Stored] = {}
        self._order: list[_Handle] = []
        self._state: set[int] = set()
        self._streams: dict[torch.device, Any] = {}
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self._next_key = 0

    def hooks(self, module: torch.nn.Module, new_step: bool = True) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks for a forward of ``module`` (whose parameters and buffers stay put)."""
        self._state = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
        if new_step:
            self.stats = OffloadStats()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @property
    def in_flight(self) -> int:
        """Storages still held on the host (0 after every backward)."""
        return len(self._stored)

    def _pack(self, t: torch.Tensor) -> Any:
        self.stats.packed += 1
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._state:
            self.stats.skipped_state += 1
            return t
        if storage.nbytes() < self.threshold or t.device.type == "meta":
            self.stats.skipped_small += 1
            return t
        key = self._key_of(storage, t.device)
        self._stored[key].refs += 1
        self.stats.offloaded += 1
        handle = _Handle(key, t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()),
                         t.requires_grad, len(self._order))
        self._order.append(handle)
        return handle

    def _key_of(self, storage: torch.UntypedStorage, device: torch.device) -> int:
        """One host copy per live storage. An address alone is not an identity: once the offloaded
        original is freed, a new tensor may be allocated at the same address."""
        ptr = storage.data_ptr()
        live = self._live.get(ptr)
        if live is not None and not live[0].expired() and live[1] in self._stored:
            return live[1]
        self._next_key += 1
        self._live[ptr] = (StorageWeakRef(storage), self._next_key)
        self._stored[self._next_key] = self._copy_out(storage, device)
        return self._next_key

    def _copy_out(self, storage: torch.UntypedStorage, device: torch.device) -> _Stored:
        start = time.perf_counter()
        nbytes = storage.nbytes()
        host = self.pool.take(nbytes)
        src = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        if device.type == "cuda":
            stream = self._side_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                host.copy_(src, non_blocking=True)
            src.record_stream(stream)
        else:
            host.copy_(src)
        self.stats.storages += 1
        self.stats.bytes_moved += nbytes
        self.stats.copy_seconds += time.perf_counter() - start
        return _Stored(host=host, device=device, nbytes=nbytes)

    def _unpack(self, handle: Any) -> torch.Tensor:
        if not isinstance(handle, _Handle):
            return handle
        stored = self._stored[handle.key]
        self._bring_back(stored)
        if stored.device.type == "cuda":
            self._prefetch_before(handle.order)
        out = torch.empty(0, dtype=handle.dtype, device=stored.device)
        assert stored.restored is not None  # _bring_back restored it
        out.set_(stored.restored, handle.offset, handle.size, handle.stride)
        self.stats.unpacked += 1
        stored.refs -= 1
        if stored.refs == 0:
            self.pool.give_back(stored.host)
            del self._stored[handle.key]
        if not self._stored:
            self._order.clear()
            self._live.clear()
        return out

    def _bring_back(self, stored: _Stored) -> None:
        if stored.restored is None:
            self._copy_in(stored)
        if stored.ready is not None:
            torch.cuda.current_stream(stored.device).wait_event(stored.ready)
            stored.ready = None

    def _copy_in(self, stored: _Stored) -> None:
        start = time.perf_counter()
        dst = torch.empty(stored.nbytes, dtype=torch.uint8, device=stored.device)
        if stored.device.type == "cuda":
            stream = self._side_stream(stored.device)
            with torch.cuda.stream(stream):
                dst.copy_(stored.host, non_blocking=True)
                stored.ready = torch.cuda.Event()
                stored.ready.record(stream)
            dst.record_stream(torch.cuda.current_stream(stored.device))
        else:
            dst.copy_(stored.host)
        stored.restored = dst.untyped_storage()
        self.stats.copy_seconds += time.perf_counter() - start

    def _prefetch_before(self, order: int) -> None:
        """Backward runs in reverse pack order: start bringing back the previous storage."""
        for i in range(order - 1, -1, -1):
            stored = self._stored.get(self._order[i].key)
            if stored is not None:
                if stored.restored is None and stored.device.type == "cuda":
                    self._copy_in(stored)
                return

    def _side_stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


def offload_region(segment: torch.nn.Module, *inputs: Any) -> Any:
    """Run ``segment`` keeping what autograd saves inside it in host memory (``offload="auto"``).

    The segment's offloader is attached by the module that owns it; in ``eval()`` or under
    ``torch.no_grad()`` nothing is saved, so the segment is simply called.
    """
    offloader: Optional[Offloader] = getattr(segment, "_fxckpt_offloader", None)
    if offloader is None or not (segment.training and torch.is_grad_enabled()):
        return segment(*inputs)
    with offloader.hooks(segment, new_step=False):
        return segment(*inputs)


offload_region.__module__ = "fxckpt.runtime"
