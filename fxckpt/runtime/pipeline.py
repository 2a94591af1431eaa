"""GPipe on one host: stages on devices, micro-batches on a fill-drain clock, checkpoint per pair.

    inputs --scatter--> micro-batches 0..M-1
        clock k runs every (i, j) with i + j = k:  stage j on devices[j] for micro-batch i
    outputs <--gather-- last stage's outputs, in micro-batch order

Each (micro-batch, stage) pair either runs plainly or under :func:`fxckpt.runtime.checkpoint`
(nothing kept, recomputed in backward). As in torchgpipe, micro-batch ``i`` is checkpointed
when ``i < checkpoint_stop``:

    checkpoint=    always        except_last     never
    stop           M             M - 1           0         (0 in eval() and under no_grad)

``except_last`` is the default because the last micro-batch's backward starts right after its
forward: freeing its activations would save nothing and cost a recompute. A recompute is counted
(``Pipeline.recomputed`` lists the pairs) when it really happens, in backward.

Devices. A stage's parameters move to its device. On CUDA every device has a compute stream and
every (source, destination) pair a copy stream, so copies overlap compute; ``wait_stream`` orders
a copy after the producer and the consumer after the copy, and ``record_stream`` keeps the caching
allocator from reusing a tensor's memory while another stream still reads it. On CPU all of that
is skipped and ``devices=["cpu", "cpu"]`` runs the same schedule.

Failures. An exception in any pair is re-raised with its own type and a note naming the stage,
device and micro-batch; every buffer of the stages is put back to its value before the step.
BatchNorm statistics are deferred (see :mod:`fxckpt.runtime.batchnorm`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, ContextManager, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from fxckpt.errors import ConfigError
from fxckpt.runtime.batchnorm import DeferredBatchNorm
from fxckpt.runtime.checkpoint import checkpoint as run_checkpointed
from fxckpt.runtime.checkpoint import is_recomputing
from fxckpt.runtime.microbatch import gather, scatter
from fxckpt.runtime.segment import Recomputable
from fxckpt.runtime.state import TensorValues
from fxckpt.runtime.schedule import (
    checkpoint_stop as _checkpoint_stop,
    clock_cycles,
    schedule_chart,
)

__all__ = ["Pipeline", "CHECKPOINT_MODES", "check_chunks", "check_checkpoint", "check_device"]

log = logging.getLogger(__name__)

CHECKPOINT_MODES = ("always", "except_last", "never")
Device = Union[str, torch.device, int]


def check_chunks(chunks: object) -> int:
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ConfigError(f"chunks must be a positive integer (got {chunks!r})")
    return chunks


def check_checkpoint(mode: object) -> str:
    if mode not in CHECKPOINT_MODES:
        raise ConfigError(
            f"checkpoint must be one of {', '.join(map(repr, CHECKPOINT_MODES))} (got {mode!r})"
        )
    return str(mode)


def check_device(device: object, name: str = "devices") -> torch.device:
    """A ``torch.device`` that exists on this machine, or :class:`ConfigError` saying why not
    (``name``: the argument it came from, for the message)."""
    try:
        dev = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError, ValueError) as e:
        what = "torch devices or strings" if name == "devices" else "a torch device or a string"
        raise ConfigError(
            f"{name} must be {what} like 'cpu' or 'cuda:0' (got {device!r}: {e})"
        ) from e
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        n = torch.cuda.device_count()
        index = dev.index if dev.index is not None else torch.cuda.current_device() if n else 0
        if index >= n:
            label = "device" if name == "devices" else name
            has = (f"{n} CUDA device(s), cuda:0 to cuda:{n - 1}" if n
                   else "no CUDA device; use 'cpu'")
            raise ConfigError(f"{label} {str(dev)!r} does not exist: this machine has {has}")
        return torch.device("cuda", index)
    backend = getattr(torch, dev.type, None)
    if backend is None or not getattr(backend, "is_available", lambda: False)():
        raise ConfigError(f"device {str(dev)!r} is not available on this machine")
    return dev


def one_device_per_stage(stages: int, devices: Any, made: str = "") -> ConfigError:
    """``devices=`` does not name one device for each of the ``stages`` (``made``: what made
    that many, ``"balance makes "``)."""
    shown = devices if isinstance(devices, (str, torch.device)) else [str(d) for d in devices]
    return ConfigError(f"give one device per stage: {made}{stages} stage(s) but devices={shown!r}")


def check_devices(devices: object) -> list[torch.device]:
    """``devices=`` (one per stage) as the devices that exist, or :class:`ConfigError`."""
    if (
        isinstance(devices, (str, torch.device))
        or not isinstance(devices, (list, tuple))
        or not devices
    ):
        raise ConfigError(
            f"devices must be a non-empty list of devices, one per stage (got {devices!r}); "
            "e.g. devices=['cuda:0', 'cuda:1']"
        )
    return [check_device(d) for d in devices]


class _Stage(Recomputable):
    """One stage as the pipeline calls it: ``(micro_batch, defer_bn, args, kwargs)`` in, output
    out. Checkpointed as a whole, restoring every buffer (BatchNorm's ``num_batches_tracked``)."""

    module: nn.Module

    def __init__(self, module: nn.Module, index: int, recomputed: list[tuple[int, int]],
                 norms: DeferredBatchNorm) -> None:
        super().__init__()
        self.module = module
        self.index = index
        self.collects = norms.covers(module)
        self.recomputed = recomputed  # the pipeline's list (a plain attribute: not a module)
        self.norms = norms
        self.name = f"pipeline stage {index}"
        self.restores = tuple(name for name, _ in self.named_buffers())

    def forward(self, micro_batch: int, defer: bool, args: tuple, kwargs: dict) -> Any:
        if is_recomputing():
            self.recomputed.append((micro_batch, self.index))
        with self.norms.collecting() if defer and self.collects else contextlib.nullcontext():
            return self.module(*args, **kwargs)


class _Streams:
    """CUDA streams: one compute stream per device, one copy stream per device pair (none on CPU).
    """

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.compute_streams = {
            d: torch.cuda.Stream(device=d) for d in set(devices) if d.type == "cuda"
        }
        self.copy_streams: dict[tuple[torch.device, torch.device], Any] = {}

    def compute(self, device: torch.device) -> ContextManager:
        stream = self.compute_streams.get(device)
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def begin(self) -> None:
        """Compute streams start after whatever the caller queued (e.g. making the inputs)."""
        for d, s in self.compute_streams.items():
            s.wait_stream(torch.cuda.current_stream(d))

    def _producer(self, device: torch.device) -> Any:
        """The stream whose work produces (or consumes) tensors on ``device``."""
        stream = self.compute_streams.get(device)
        return stream if stream is not None else torch.cuda.current_stream(device)

    def _copy_stream(self, device: torch.device, peer: torch.device) -> Any:
        """The stream on ``device`` that copies to or from ``peer``."""
        key = (device, peer)
        if key not in self.copy_streams:
            self.copy_streams[key] = torch.cuda.Stream(device=device)
        return self.copy_streams[key]

    def transfer(self, value: Any, dst: torch.device) -> Any:
        """``value`` with every tensor on ``dst`` (``.to(dst, non_blocking=True)``)."""
        return pytree.tree_map_only(torch.Tensor, lambda t: self._move(t, dst), value)

    def _move(self, t: torch.Tensor, dst: torch.device) -> torch.Tensor:
        src = t.device
        if src.type != "cuda" and dst.type != "cuda":
            return t.to(dst, non_blocking=True)
        if src == dst:
            t.record_stream(self._producer(dst))
            return t
        # As torchgpipe's Copy: a copy stream on each CUDA side is current while copying.
        streams = [
            (d, self._copy_stream(d, peer))
            for d, peer in ((src, dst), (dst, src))
            if d.type == "cuda"
        ]
        if src.type == "cuda":
            streams[0][1].wait_stream(self._producer(src))
        with contextlib.ExitStack() as stack:
            for _, stream in streams:
                stack.enter_context(torch.cuda.stream(stream))
            out = t.to(dst, non_blocking=True)
        for d, stream in streams:
            (t if d == src else out).record_stream(stream)
        if dst.type == "cuda":
            consumer = self._producer(dst)
            consumer.wait_stream(streams[-1][1])
            out.record_stream(consumer)
        else:
            streams[0][1].synchronize()  # the CPU reads it next
        return out

    def finish(self, value: Any, device: torch.device) -> Any:
        """Hand the outputs over to the caller's current stream."""
        stream = self.compute_streams.get(device)
        if stream is None:
            return value
        current = torch.cuda.current_stream(device)
        current.wait_stream(stream)
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor) and t.device == device:
                t.record_stream(current)
        return value


class Pipeline(nn.Module):
    """Run ``stages`` as a GPipe pipeline over ``devices`` with ``chunks`` micro-batches.

    Stage ``j+1`` is called with the output of stage ``j`` (a tuple is unpacked into positional
    arguments); stage 0 with the micro-batch's ``(*args, **kwargs)``. ``input_names`` name the
    positional inputs in error messages.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        devices: Sequence[Device],
        chunks: int,
        checkpoint: str = "except_last",
        *,
        input_names: Optional[Sequence[str]] = None,
    ) -> None:
        super().__init__()
        if not stages or not all(isinstance(s, nn.Module) for s in stages):
            raise ConfigError(f"stages must be a non-empty list of nn.Module (got {stages!r})")
        if isinstance(devices, (str, torch.device)) or len(devices) != len(stages):
            raise one_device_per_stage(len(stages), devices)
        self.chunks = check_chunks(chunks)
        self.checkpoint = check_checkpoint(checkpoint)
        self.devices = [check_device(d) for d in devices]
        _check_shared_state(stages, self.devices)
        self.input_names = list(input_names) if input_names is not None else None
        self.recomputed: list[tuple[int, int]] = []
        self.norms = DeferredBatchNorm(m for s in stages for m in s.modules())
        self.stages = nn.ModuleList(
            _Stage(s.to(d), j, self.recomputed, self.norms)
            for j, (s, d) in enumerate(zip(stages, self.devices))
        )
        self._streams = _Streams(self.devices)

    def checkpoint_stop(self, micro_batches: int) -> int:
        """Micro-batches ``i < checkpoint_stop`` are checkpointed (torchgpipe's rule)."""
        if not (self.training and torch.is_grad_enabled()):
            return 0
        return _checkpoint_stop(micro_batches, self.checkpoint)

    def schedule_chart(self, micro_batches: Optional[int] = None) -> str:
        """The forward schedule as ASCII, with the bubble fraction and checkpointed pairs marked.
        """
        m = micro_batches or self.chunks
        return schedule_chart(m, len(self.stages), recompute_stop=self.checkpoint_stop(m))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        micro = scatter(args, kwargs, self.chunks, self.input_names)
        stop = self.checkpoint_stop(len(micro))
        defer = self.training and len(micro) > 1 and self.norms.active
        self.recomputed.clear()
        saved = TensorValues(self.buffers() if self.training else ())
        if defer:
            self.norms.begin()
        try:
            outputs = self._run(micro, stop, defer)
        except BaseException:
            self.norms.abort()
            saved.restore()
            raise
        if defer:
            self.norms.commit()
        return gather(outputs)

    def _run(self, micro: list[tuple[tuple, dict]], stop: int, defer: bool) -> list[Any]:
        self._streams.begin()
        values: list[Any] = list(micro)
        last = len(self.stages) - 1
        for pairs in clock_cycles(len(micro), len(self.stages)):
            for i, j in pairs:
                values[i] = self._task(i, j, values[i], stop, defer, len(micro))
                if j < last:
                    values[i] = (values[i] if isinstance(values[i], tuple) else (values[i],), {})
        return [self._streams.finish(v, self.devices[last]) for v in values]

    def _task(
        self, i: int, j: int, inputs: tuple[tuple, dict], stop: int, defer: bool, m: int
    ) -> Any:
        device, stage = self.devices[j], self.stages[j]
        try:
            args, kwargs = self._streams.transfer(inputs, device)
            with self._streams.compute(device):
                if i < stop:
                    log.debug(
                        "micro-batch %d/%d on stage %d (%s): checkpointed, recomputed in backward "
                        "(checkpoint_stop=%d)",
                        i,
                        m,
                        j,
                        device,
                        stop,
                    )
                    return run_checkpointed(stage, i, defer, args, kwargs)
                log.debug("micro-batch %d/%d on stage %d (%s): not checkpointed, activations kept "
                          "(checkpoint_stop=%d)", i, m, j, device, stop)
                return stage(i, defer, args, kwargs)
        except Exception as e:
            _add_note(
                e,
                f"fxckpt pipeline: raised by stage {j} on {device} for micro-batch {i} of {m} "
                f"(clock {i + j}); the stages' buffers were restored to their values before this "
                "step",
            )
            raise

    def extra_repr(self) -> str:
        return (
            f"chunks={self.chunks}, checkpoint={self.checkpoint!r}, "
            f"devices={[str(d) for d in self.devices]}"
        )


def _check_shared_state(stages: Sequence[nn.Module], devices: Sequence[torch.device]) -> None:
    """A parameter or buffer used by stages on different devices cannot live on both."""
    owner: dict[int, tuple[int, str]] = {}
    for j, s in enumerate(stages):
        for name, t in [*s.named_parameters(), *s.named_buffers()]:
            first = owner.setdefault(id(t), (j, name))
            if devices[first[0]] != devices[j]:
                raise ConfigError(
                    f"{name!r} is used by stage {first[0]} on {devices[first[0]]} and stage {j} "
                    f"on {devices[j]} (tied weights?); put those stages on one device or choose "
                    "other stage boundaries"
                )


def _add_note(e: BaseException, note: str) -> None:
    if hasattr(e, "add_note"):
        e.add_note(note)
    else:  # Python 3.10: no notes; keep the type and say it in the log
        log.error(note)
