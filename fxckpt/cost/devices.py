"""Device profiles: what a node costs in time on the device the plan will run on.

The solver minimises recompute time under a memory budget, so it needs each node's time. On
this project's CPU that is a price table measured op by op (:mod:`fxckpt.cost.prices`), where
a pointwise op costs as much per byte as a matmul. A GPU is different: a matmul runs at hundreds
of TFLOP/s while pointwise ops are bound by memory bandwidth, so recomputing a SwiGLU is nearly
free and recomputing a projection is not. A :class:`DeviceProfile` prices a node as a roofline,

    seconds = max(FLOPs / matmul rate of its dtype, bytes read and written / memory bandwidth)
              + calls x launch overhead

and each checkpointed segment (and each kept node) a fixed overhead, the Python around torch's
checkpoint. Costs reach the solver in FLOP-equivalents at the profile's bf16 matmul rate
(:attr:`DeviceProfile.unit`), so a plan priced for a GPU and one priced for the CPU read alike.
Moving a byte to host memory and back costs ``2 / link`` seconds (``offload="auto"``).

Profiles come three ways (:func:`profile_for`):

* named, for planning on the CPU or the meta device for a GPU the plan will run on
  (``transform(..., device_profile="h100")``, ``fxckpt plan --meta --device-profile h100``):
  :data:`PROFILES` holds H100, H200 and A100 at about the rates kernels reach (75-85% of the data
  sheet's dense peaks; sources beside each);
* measured, on the model's GPU at the first plan (``device_profile=None``): a bf16 and an fp32
  matmul, a copy through device memory, a copy to pinned host memory and a run of tiny kernels,
  about a second in all, once per device and process; on a CPU (the default for a model
  there), its price table measured op by op as plans need them (:mod:`fxckpt.cost.cpu_table`);
* ``"cpu"``: the CPU price table measured once on this project's benchmark machine
  (:data:`fxckpt.cost.prices.TABLE`): the same plan on every machine.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, Optional

import torch

from fxckpt.cost.prices import KEEP_COST, SAVED_COST, SEGMENT_COST, Prices
from fxckpt.errors import ConfigError

__all__ = ["DeviceProfile", "PROFILES", "profile_for", "measure_profile", "cpu_profile",
           "copies_overlap", "offload_price"]


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Rates of one device (see the module docstring)."""

    name: str
    matmul: Mapping[str, float]
    """Matmul FLOP/s by dtype name (``bfloat16``, ``float16``, ``float32``)."""
    memory: float
    """Device memory bandwidth, bytes/s (read plus write)."""
    link: float
    """Device to host memory bandwidth (pinned), bytes/s."""
    launch: float = 5e-6
    """Seconds per aten call beyond its roofline time (dispatch and kernel launch)."""
    segment: float = 1.5e-4
    """Seconds per checkpointed segment: torch's checkpoint machinery, forward and backward
    (164 us measured on this project's CPU, which runs the same Python for a GPU step)."""
    keep: float = 1e-4
    """Seconds per node a segment keeps from forward (selective recompute's bookkeeping)."""
    saved: float = 1.6e-5
    """Seconds per tensor an op in a segment saves: the checkpoint's saved-tensor hooks, in
    Python (16 us measured on this project's CPU, which runs the same Python for a GPU step)."""
    table: Optional[Prices] = None
    """A CPU's prices per call and byte (:mod:`fxckpt.cost.cpu_table`): nodes are priced by
    them, not by the roofline."""

    @property
    def unit(self) -> float:
        """FLOP-equivalents per second of cost (the bf16 matmul rate)."""
        return self.matmul["bfloat16"]

    def seconds(self, flops: float, moved: float, calls: int, dtype: Optional[str]) -> float:
        """A node's roofline time."""
        rate = self.matmul.get(dtype or "float32", self.matmul["float32"])
        return max(flops / rate, moved / self.memory) + calls * self.launch

    def cost(self, flops: float, moved: float, calls: int, dtype: Optional[str]) -> float:
        """A node's time in the solver's FLOP-equivalents."""
        return self.seconds(flops, moved, calls, dtype) * self.unit


def _rates(bf16: float, fp32: float) -> Mapping[str, float]:
    return {"bfloat16": bf16, "float16": bf16, "float32": fp32}


PROFILES: dict[str, Optional[DeviceProfile]] = {
    # H100 SXM: 989 TFLOP/s dense bf16, 67 TFLOP/s fp32 (torch's default: no TF32 for matmul),
    # 3.35 TB/s HBM3; host link 53 GB/s, measured device to host over PCIe 5.
    "h100": DeviceProfile("h100", _rates(780e12, 52e12), memory=2.8e12, link=53e9),
    # H200: the H100's compute with 4.8 TB/s HBM3e.
    "h200": DeviceProfile("h200", _rates(780e12, 52e12), memory=4.0e12, link=53e9),
    # A100 80GB SXM: 312 TFLOP/s bf16, 19.5 TFLOP/s fp32, 2.04 TB/s HBM2e, PCIe 4.
    "a100": DeviceProfile("a100", _rates(250e12, 16e12), memory=1.7e12, link=25e9),
    "cpu": None,  # the measured CPU price table of fxckpt.cost.prices
}
"""Named profiles; ``None`` means the CPU price table."""


def profile_for(name: Optional[str], device: torch.device) -> Optional[DeviceProfile]:
    """The profile plans are priced with: the named one, or for ``None`` the device's own
    (measured on a GPU or a CPU; the table on the meta device, and on a CPU under
    ``FXCKPT_CPU_PRICES=table``). ``None`` means the CPU price table."""
    if name is not None:
        if name not in PROFILES:
            raise ConfigError(f"device_profile must be one of {', '.join(map(repr, PROFILES))} "
                              f"(got {name!r}), or None for the model's own device")
        return PROFILES[name]
    if device.type == "cuda":
        return measure_profile(device)
    if device.type == "cpu":
        from fxckpt.cost.cpu_table import uses_measured_prices

        return cpu_profile() if uses_measured_prices() else None
    return None


@functools.cache
def cpu_profile() -> DeviceProfile:
    """This CPU's profile: its price table measured here (:mod:`fxckpt.cost.cpu_table`). The
    overheads of a segment, a kept node and a saved tensor are the table's in seconds: Python
    around torch's checkpoint, measured at 300, 120 and 17 us on an Intel Xeon whose aten calls
    run twice as fast as the benchmark machine's (312, 104, 16 us there). Once per process."""
    from fxckpt.cost.cpu_table import TABLE_RATE, measured_table
    from fxckpt.cost.rates import measure_rates

    table = measured_table()
    _, bandwidth = measure_rates("cpu", "cpu")
    rates = {"bfloat16": table.rate, "float16": table.rate, "float32": table.rate}
    return DeviceProfile("measured cpu", rates, memory=bandwidth, link=bandwidth,
                         launch=table.call / table.rate, segment=SEGMENT_COST / TABLE_RATE,
                         keep=KEEP_COST / TABLE_RATE, saved=SAVED_COST / TABLE_RATE, table=table)


@functools.cache
def measure_profile(device: torch.device) -> DeviceProfile:
    """The rates of ``device``, measured in about a second (once per device and process)."""
    from fxckpt.cost.rates import fastest

    n = 4096
    rates = {}
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.full((n, n), 0.5, device=device, dtype=dtype)
        rates[str(dtype).removeprefix("torch.")] = 2 * n**3 / fastest(lambda: a @ a, device)
    rates["float16"] = rates["bfloat16"]
    big = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    other = torch.empty_like(big)
    memory = 2 * big.numel() / fastest(lambda: other.copy_(big), device)
    pinned = torch.empty(1 << 26, dtype=torch.uint8, pin_memory=device.type == "cuda")
    link = pinned.numel() / fastest(lambda: pinned.copy_(big[: pinned.numel()], non_blocking=True),
                                  device)
    tiny = torch.zeros(1, device=device)
    launch = fastest(lambda: [tiny.add_(1) for _ in range(100)], device) / 100
    return DeviceProfile(f"measured {torch.cuda.get_device_name(device)}"
                         if device.type == "cuda" else f"measured {device}",
                         rates, memory=memory, link=link, launch=launch)


def copies_overlap(name: Optional[str], device: torch.device) -> bool:
    """Whether the offloader's copies run beside the compute in the step a plan is made for: a
    GPU's side stream, for a model on CUDA or one planned with a GPU profile. A CPU's copies
    are synchronous (:mod:`fxckpt.planning.overlap`)."""
    if name is not None:
        return PROFILES.get(name) is not None
    return device.type == "cuda"


def offload_price(profile: Optional[DeviceProfile], bandwidth: Optional[float],
                  device: torch.device | str = "cpu", host: torch.device | str = "cpu") -> float:
    """FLOP-equivalents of moving one saved byte out and back, in the units the plan is priced
    in: with a device profile, its matmul rate over ``bandwidth`` (the profile's host link when
    ``None``), so nothing is timed and a plan for a GPU can be made on the meta device; without
    one, :func:`~fxckpt.cost.rates.offload_cost_per_byte` on the model's device (the CPU for a
    meta model, whose plan is priced with the CPU's table)."""
    from fxckpt.cost.rates import offload_cost_per_byte

    if profile is not None:
        return 2.0 * profile.unit / (bandwidth or profile.link)
    device = torch.device(device)
    return offload_cost_per_byte(bandwidth, "cpu" if device.type == "meta" else device, host)
