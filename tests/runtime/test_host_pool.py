"""Host buffers for offloaded tensors (fxckpt.runtime.host_pool)."""

from __future__ import annotations

import pytest
import torch

import fxckpt
from fxckpt.runtime.host_pool import HostPool, host_device


def test_a_buffer_given_back_is_taken_again_for_the_same_size_with_its_fence() -> None:
    pool = HostPool(pin=False)
    buf, fence = pool.take(64)
    assert fence is None and buf.dtype == torch.uint8 and buf.numel() == 64
    assert pool.in_use_bytes == 64 and pool.allocated_bytes == 64
    pool.give_back(buf, fence="event")
    assert pool.in_use_bytes == 0
    again, fence = pool.take(64)
    assert again is buf and fence == "event" and pool.allocated_bytes == 64  # reused
    other, _ = pool.take(32)
    assert other is not buf and pool.allocated_bytes == 96


def test_only_the_cpu_or_an_existing_cuda_device_holds_offloaded_tensors() -> None:
    assert host_device("cpu") == torch.device("cpu")
    with pytest.raises(fxckpt.ConfigError, match="must be 'cpu' or a CUDA device .*'meta'"):
        host_device("meta")
    with pytest.raises(fxckpt.ConfigError, match="like 'cuda:0'"):
        host_device("not a device")
    if not torch.cuda.is_available():
        with pytest.raises(fxckpt.ConfigError, match="this machine has no CUDA device"):
            host_device("cuda:0")
