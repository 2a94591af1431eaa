"""measure/tracker.py: LiveTensorTracker counts the storages ops allocate while it is active,
once each, until they are freed; views, in-place results and what existed before never count."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxckpt.measure.tracker import LiveTensorTracker

KIB = 1024


def test_new_storages_count_until_freed_and_the_peak_stays() -> None:
    x = torch.ones(256)  # existed before: never counted
    with LiveTensorTracker() as t:
        a = x * 2  # 1 KiB
        b = a + 1  # 1 KiB
        assert t.current_bytes == 2 * KIB
        del a
        assert t.current_bytes == KIB
        c = torch.zeros(512)  # 2 KiB
    assert (t.current_bytes, t.peak_bytes, t.allocated_bytes) == (3 * KIB, 3 * KIB, 4 * KIB)
    del b, c  # freed after the tracker exited: still uncounted
    assert t.current_bytes == 0 and t.peak_bytes == 3 * KIB


def test_views_and_in_place_results_are_not_allocations() -> None:
    x = torch.ones(256)
    with LiveTensorTracker() as t:
        v = x.view(16, 16)
        x.mul_(2)
        w = v.t()
    assert t.allocated_bytes == 0 and t.peak_bytes == 0
    del v, w


def test_reset_peak_lowers_the_peak_to_what_is_alive() -> None:
    with LiveTensorTracker() as t:
        a = torch.ones(256)
        b = torch.ones(256)
        del b
        assert t.peak_bytes == 2 * KIB
        t.reset_peak()
        assert t.peak_bytes == KIB
    assert t.peak_bytes_by_device == {"cpu": KIB} and t.current_bytes_by_device == {"cpu": KIB}
    del a


def test_scratch_a_kernel_allocates_raises_the_peak_only() -> None:
    def scratch(func, args, kwargs) -> int:
        return 10 * KIB if func is torch.ops.aten.mm.default else 0

    m = torch.ones(16, 16)
    with LiveTensorTracker(scratch=scratch) as t:
        out = m @ m  # 1 KiB out, 10 KiB while it ran
    assert t.current_bytes == KIB and t.peak_bytes == 11 * KIB
    del out


def test_fake_tensors_count_only_when_asked() -> None:
    with FakeTensorMode():
        x = torch.ones(256)
        with LiveTensorTracker() as plain:
            a = x * 2
        with LiveTensorTracker(fake=True) as fake:
            b = x * 2
    assert plain.peak_bytes == 0 and fake.peak_bytes == KIB
    del a, b
