"""Run a test body on several CPU processes joined by a gloo process group."""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(body: Callable[..., None], *args: Any, world: int = 2) -> None:
    """``body(rank, world, *args)`` on ``world`` processes; any failure fails the caller."""
    mp.spawn(_entry, args=(world, _free_port(), body, args), nprocs=world, join=True)


def _entry(rank: int, world: int, port: int, body: Callable[..., None], args: tuple) -> None:
    faulthandler.enable()  # a native abort prints the rank's Python stack into the test's log
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        torch.set_num_threads(1)  # several processes on a shared 2-core machine
        body(rank, world, *args)
        # Every rank done communicating before any tears gloo down: destroying a group while the
        # peer still had point-to-point work in flight aborted a rank ("terminate called without
        # an active exception") in one CI run.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Passed: leave without the interpreter's teardown. One CI run aborted rank 0 of an FSDP2
    # test ("terminate called without an active exception"); the likeliest place is that
    # teardown, where objects still holding the group (FSDP2's device mesh, the store rank 0
    # serves) are destroyed with native threads of theirs running. faulthandler names the place
    # if an abort comes back inside the test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
