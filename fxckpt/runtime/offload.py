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

Lifetime is autograd's: the object the pack hook returns (a :class:`_Handle`) owns a reference
to the host copy (:class:`_Stored`), and autograd keeps it exactly as long as it keeps a saved
tensor. Unpacking does not consume it, so ``backward(retain_graph=True)`` can be followed by
another backward; freeing the graph (after a backward, or a forward whose output is dropped, or
one that raised) drops the last handle and the host buffer goes back to the pool. In backward,
one storage is brought back once per pass and shared by all its views; the device copy is
released when every live handle of it has been unpacked in that pass.

Host buffers live on ``device`` (``offload_device``) and come from a :class:`HostPool` reused
across steps (pinned CPU memory when CUDA is present, with a pageable fallback when pinning
fails). On CUDA every copy runs on a side stream of the source device that first waits for the
compute stream (``wait_stream``), and ``record_stream`` marks each device block with the stream
that uses it: the source of a copy to the host is read there, and the destination of a copy
back is allocated on the compute stream but written there, so the caching allocator cannot hand
either out while the copy is queued. The compute stream waits for an event before using a tensor
brought back. In backward, the storage packed before the current one is prefetched. A host
buffer given back carries an event on the stream that last used it; the next copy into it waits.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import time
import weakref
from typing import Any, Iterator, Optional, Union

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from fxckpt.runtime.host_pool import HostPool, host_device
from fxckpt.runtime.segment import SegmentModule

__all__ = ["HostPool", "Offloader", "OffloadStats", "offload_region", "offload_simulated"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class OffloadStats:
    """What the latest training step moved."""

    packed: int = 0
    """Saved tensors handed to the offloader (offloaded or not)."""
    offloaded: int = 0
    """Saved tensors sent to host memory."""
    unpacked: int = 0
    """Offloaded tensors brought back in backward (each backward pass counts again)."""
    restored: int = 0
    """Storages copied back (views share one; once per storage and backward pass)."""
    storages: int = 0
    """Distinct storages copied (a view and its base count once)."""
    bytes_moved: int = 0
    """Bytes copied device -> host (each storage once)."""
    skipped_small: int = 0
    skipped_state: int = 0
    copy_seconds: float = 0.0
    """Wall time spent issuing/doing copies (on CUDA, issuing only: they are asynchronous)."""


class _Stored:
    """One storage copied to the host; shared by every saved view of it, alive while a handle is.

    ``restored`` is the storage brought back in the current backward pass (``None`` outside one),
    kept until every live handle has been unpacked (``unpacked`` holds their ids); ``prev`` is the
    storage packed just before this one in the same step (what backward needs next).
    """

    def __init__(self, host: torch.Tensor, device: torch.device, nbytes: int, version: int,
                 side: Optional[Any], prev: Optional[weakref.ref[_Stored]]) -> None:
        self.host = host
        self.device = device
        self.nbytes = nbytes
        self.version = version  # when copied: after an in-place write, a new copy is needed
        self.side = side  # the CUDA side stream its copies run on
        self.prev = prev
        self.handles = 0
        self.unpacked: set[int] = set()
        self.task = -2  # autograd graph task of the latest unpack
        self.restored: Optional[torch.UntypedStorage] = None
        self.ready: Optional[Any] = None  # a CUDA event while a copy back is in flight

    def release_if_done(self) -> None:
        """Every live handle was unpacked in this pass: drop the device copy."""
        if len(self.unpacked) >= self.handles:
            self.restored, self.ready = None, None
            self.unpacked.clear()


def _release(pool: HostPool, host: torch.Tensor, side: Optional[Any]) -> None:
    """The last handle of a host copy is gone: its buffer goes back, fenced on its stream."""
    fence = None
    if side is not None:
        fence = torch.cuda.Event()
        fence.record(side)
    pool.give_back(host, fence)


class _Handle:
    """What autograd keeps for one offloaded saved tensor: its host copy and its layout."""

    __slots__ = ("stored", "dtype", "size", "stride", "offset")

    def __init__(self, stored: _Stored, t: torch.Tensor) -> None:
        self.stored = stored
        self.dtype = t.dtype
        self.size = tuple(t.shape)
        self.stride = tuple(t.stride())
        self.offset = int(t.storage_offset())
        stored.handles += 1

    def __del__(self) -> None:
        stored = self.stored
        stored.handles -= 1
        stored.unpacked.discard(id(self))
        if stored.restored is not None:
            stored.release_if_done()


_Live = tuple[StorageWeakRef, "weakref.ref[_Stored]"]
"""A storage copied to the host, and its host copy (either may be gone)."""


class Offloader:
    """Saved-tensor hooks that offload to ``device`` (see the module docstring)."""

    def __init__(self, device: Union[torch.device, str] = "cpu", threshold: int = 1 << 20) -> None:
        self.device = host_device(device)
        self.threshold = threshold
        self.pool = HostPool(pin=torch.cuda.is_available() and self.device.type == "cpu",
                             device=self.device)
        self.stats = OffloadStats()
        self._state: set[int] = set()
        self._streams: dict[torch.device, Any] = {}
        self._live: dict[tuple[torch.device, int], _Live] = {}
        self._alive: weakref.WeakSet[_Stored] = weakref.WeakSet()
        self._last: Optional[weakref.ref[_Stored]] = None
        self._chain_of: Optional[OffloadStats] = None

    def hooks(self, module: torch.nn.Module,
              new_step: bool = True) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks for a forward of ``module`` (whose parameters and buffers stay put)."""
        self.begin(module, new_step)
        return self.saving()

    def begin(self, module: torch.nn.Module, new_step: bool = True) -> None:
        """A forward of ``module`` starts: its parameters and buffers stay put (``new_step``:
        the stats count this step's tensors)."""
        state = (*module.parameters(), *module.buffers())
        self._state = {t.untyped_storage()._cdata for t in state}  # fake storages have no address
        if new_step:
            self.stats = OffloadStats()

    def saving(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks for part of the forward :meth:`begin` started (a Dynamo graph of it)."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @property
    def in_flight(self) -> int:
        """Host copies still referenced by a live autograd graph (0 once every graph is freed)."""
        return len(self._alive)

    def simulating(self, module: torch.nn.Module) -> torch.autograd.graph.saved_tensors_hooks:
        """The hooks for a forward of ``module`` under :func:`offload_simulated`: what
        :meth:`hooks` would move is dropped until backward unpacks it, then made again empty."""
        self.begin(module, new_step=False)
        return torch.autograd.graph.saved_tensors_hooks(self._pack_away, _made_again)

    def _stays(self, storage: torch.UntypedStorage) -> str:
        """Why a saved tensor of ``storage`` stays on its device (``""``: it moves)."""
        if storage._cdata in self._state:
            return "state"
        return "small" if storage.nbytes() < max(self.threshold, 1) else ""

    def _pack(self, t: torch.Tensor) -> Any:
        self.stats.packed += 1
        storage = t.untyped_storage()
        why = self._stays(storage) or ("small" if t.device.type == "meta" else "")
        if why == "state":
            self.stats.skipped_state += 1
            return t
        if why:
            self.stats.skipped_small += 1
            return t
        self.stats.offloaded += 1
        return _Handle(self._stored_for(storage, t), t)

    def _pack_away(self, t: torch.Tensor) -> Any:
        return t if self._stays(t.untyped_storage()) else _Away(t)

    def _stored_for(self, storage: torch.UntypedStorage, t: torch.Tensor) -> _Stored:
        """One host copy per live storage and version. An address alone is not an identity: once
        the offloaded original is freed, a new tensor may be allocated at the same address; and a
        storage written in place after it was copied needs a new copy (views share the version)."""
        key = (t.device, storage.data_ptr())
        live = self._live.get(key)
        if live is not None and not live[0].expired():
            stored = live[1]()
            if stored is not None and stored.version == t._version:
                return stored
        if self._chain_of is not self.stats:  # a new step: backward will not go past its start
            self._chain_of, self._last = self.stats, None
        stored = self._copy_out(storage, t.device, t._version)
        if len(self._live) > 2 * len(self._alive) + 16:
            self._live = {k: v for k, v in self._live.items() if v[1]() is not None}
        self._live[key] = (StorageWeakRef(storage), weakref.ref(stored))
        self._alive.add(stored)
        self._last = weakref.ref(stored)
        return stored

    def _copy_out(self, storage: torch.UntypedStorage, device: torch.device,
                  version: int) -> _Stored:
        start = time.perf_counter()
        nbytes = storage.nbytes()
        host, fence = self.pool.take(nbytes)
        src = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
        side = None
        if device.type == "cuda":
            side = self._side_stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            if fence is not None:
                side.wait_event(fence)
            with torch.cuda.stream(side):
                host.copy_(src, non_blocking=True)
            src.record_stream(side)
        else:
            host.copy_(src)
        stored = _Stored(host, device, nbytes, version, side, self._last)
        weakref.finalize(stored, _release, self.pool, host, side).atexit = False
        self.stats.storages += 1
        self.stats.bytes_moved += nbytes
        self.stats.copy_seconds += time.perf_counter() - start
        return stored

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            return packed
        stored = packed.stored
        storage = self._bring_back(stored)
        stored.task = _graph_task()
        if stored.side is not None:
            self._prefetch(stored)
        out = torch.empty(0, dtype=packed.dtype, device=stored.device)
        out.set_(storage, packed.offset, packed.size, packed.stride)
        self.stats.unpacked += 1
        stored.unpacked.add(id(packed))
        stored.release_if_done()
        return out

    def _bring_back(self, stored: _Stored) -> torch.UntypedStorage:
        if stored.restored is None:
            self._copy_in(stored)
        if stored.ready is not None:
            torch.cuda.current_stream(stored.device).wait_event(stored.ready)
            stored.ready = None
        assert stored.restored is not None  # _copy_in restored it
        return stored.restored

    def _copy_in(self, stored: _Stored) -> None:
        start = time.perf_counter()
        dst = torch.empty(stored.nbytes, dtype=torch.uint8, device=stored.device)
        side = stored.side
        if side is not None:
            # dst is allocated on the compute stream, whose queued kernels may still use its block
            side.wait_stream(torch.cuda.current_stream(stored.device))
            with torch.cuda.stream(side):
                dst.copy_(stored.host, non_blocking=True)
                stored.ready = torch.cuda.Event()
                stored.ready.record(side)
            dst.record_stream(side)  # freed before the copy ran: not reused until it has
        else:
            dst.copy_(stored.host)
        stored.restored = dst.untyped_storage()
        self.stats.restored += 1
        self.stats.copy_seconds += time.perf_counter() - start

    def _prefetch(self, stored: _Stored) -> None:
        """Backward runs in reverse pack order: start bringing back the storage packed before."""
        prev = stored.prev() if stored.prev is not None else None
        if prev is not None and prev.restored is None and prev.task != stored.task:
            self._copy_in(prev)

    def _side_stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


def _graph_task() -> int:
    """The id of the running backward (-1 outside one): a pass marker for prefetching."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return int(current()) if current is not None else -1


_SIMULATED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fxckpt_offload_simulated", default=False)


@contextlib.contextmanager
def offload_simulated() -> Iterator[None]:
    """Within it (on this thread), segments the plan offloads move nothing, but what the device
    holds is what offload leaves on it.

    Verification runs a step on fake or meta tensors (:mod:`fxckpt.measure.verify`), where there
    is nothing to copy and no stream or pinned pool. What the offloader would move (the same
    tensors: not the module's state, not under its threshold) is dropped from the device in
    forward and made again, empty and of the same layout, when backward unpacks it: the device
    holds it from then on, as it holds the copy brought back. A step verified so has the peak of
    the plan with offload, not of the plan without it.
    """
    token = _SIMULATED.set(True)
    try:
        yield
    finally:
        _SIMULATED.reset(token)


class _Away:
    """A saved tensor offload would have moved: its layout, made again on unpack."""

    __slots__ = ("size", "stride", "dtype", "device")

    def __init__(self, t: torch.Tensor) -> None:
        self.size, self.stride = tuple(t.shape), tuple(t.stride())
        self.dtype, self.device = t.dtype, t.device


def _made_again(packed: Any) -> torch.Tensor:
    """Unpack under :func:`offload_simulated`: an empty tensor of the layout that was dropped."""
    if not isinstance(packed, _Away):
        return packed
    return torch.empty_strided(packed.size, packed.stride, dtype=packed.dtype,
                               device=packed.device)


def offload_region(segment: SegmentModule, *inputs: Any) -> Any:
    """Run ``segment`` keeping what autograd saves inside it in host memory (``offload="auto"``).

    The segment's offloader is given to it when its graph is lowered
    (:attr:`SegmentModule.offloader`, :func:`fxckpt.passes.lower.lower`); in ``eval()``, under
    ``torch.no_grad()`` nothing goes to the host, so the segment is simply called; under
    :func:`offload_simulated` nothing moves, but what would is off the device until backward.
    """
    offloader = segment.offloader
    if offloader is None or not (segment.training and torch.is_grad_enabled()):
        return segment(*inputs)
    if _SIMULATED.get():
        with offloader.simulating(segment):
            return segment(*inputs)
    with offloader.hooks(segment, new_step=False):
        return segment(*inputs)


offload_region.__module__ = "fxckpt.runtime"
