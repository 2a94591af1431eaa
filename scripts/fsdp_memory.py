"""Peak activation memory of a training step under FSDP2, with and without fxckpt.

The figures of docs/distributed.md:

    MALLOC_MMAP_THRESHOLD_=65536 python scripts/fsdp_memory.py

Two gloo processes on CPU; an 8-block MLP (width 1024, batch 1024 per rank). Per configuration,
rank 0 reports ``VmHWM - VmRSS`` around each of 4 steps (after ``clear_refs``); the median of
steps 2-4 is printed. Configurations: FSDP2 alone, FSDP2 + fxckpt ``depth=2``, and both without
FSDP for comparison.
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import fxckpt

CONFIGS = {"fsdp": (True, False), "fsdp+fxckpt": (True, True),  # (fully_shard, fxckpt.transform)
           "plain": (False, False), "fxckpt": (False, True)}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.fc(x))


class Net(nn.Module):
    def __init__(self, depth: int = 8, width: int = 1024) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _worker(rank: int, world: int, port: int, config: str, results: "mp.SimpleQueue") -> None:
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    shard, transform = CONFIGS[config]
    module: nn.Module = Net()
    if transform:
        module = fxckpt.transform(module, depth=2)
    if shard:
        for block in module.layers:
            fully_shard(block)
        fully_shard(module)
    x = torch.randn(1024, 1024)
    peaks = []
    for _ in range(4):
        for p in module.parameters():
            p.grad = None
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status("VmRSS")
        module(x).pow(2).sum().backward()
        peaks.append(_status("VmHWM") - before)
    dist.barrier()
    if rank == 0:
        results.put(statistics.median(peaks[1:]) / 2**20)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        sys.exit("set MALLOC_MMAP_THRESHOLD_=65536 so freed tensors go back to the OS")
    results = mp.get_context("spawn").SimpleQueue()
    for config in CONFIGS:
        mp.spawn(_worker, args=(2, _free_port(), config, results), nprocs=2, join=True)
        print(f"{config:12s} peak activation memory (rank 0): {results.get():6.1f} MiB")


if __name__ == "__main__":
    main()
