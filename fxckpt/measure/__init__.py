"""Running a training step on fake or real tensors, and measuring it.

* :mod:`~fxckpt.measure.protocol`: the RSS protocol, tracked peaks, steps timed by turns, the
  measuring subprocess (what ``fxckpt.measure`` has always exported, re-exported here);
* :mod:`~fxckpt.measure.tracker`: the live-tensor tracker, storages counted at the dispatcher;
* :mod:`~fxckpt.measure.timeline`: measured memory over one step, op by op;
* :mod:`~fxckpt.measure.meta_run`: running a graph on meta and fake tensors (twins of a module);
* :mod:`~fxckpt.measure.verify`: a training step run on fake tensors, the verified peak of a plan;
* :mod:`~fxckpt.measure.loss_probe`: what the user's ``loss_fn`` holds, measured on fake tensors.

Only the protocol and the tracker are imported with the package: verification and the loss
probe reach the runtime and the cost rules, and load when first imported by their path.
"""

from fxckpt.errors import MeasureError
from fxckpt.measure.protocol import (
    MMAP_THRESHOLD,
    calibrate_rss,
    error_text,
    read_status,
    reset_peak_rss,
    run_in_subprocess,
    step_memory,
    step_peak_rss,
    step_peak_tracked,
    time_by_turns,
    time_step,
    training_step,
)
from fxckpt.measure.tracker import LiveTensorTracker, Scratch

__all__ = [
    "MMAP_THRESHOLD",
    "LiveTensorTracker",
    "MeasureError",
    "Scratch",
    "calibrate_rss",
    "error_text",
    "read_status",
    "reset_peak_rss",
    "run_in_subprocess",
    "step_memory",
    "step_peak_rss",
    "step_peak_tracked",
    "time_by_turns",
    "time_step",
    "training_step",
]
