"""serve/sizes.py: the sizes a growing call is planned at (buckets of grown dimensions), the
placeholders standing for them, and the line through verified peaks that predicts the next."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from fxckpt.serve.sizes import (Growth, bucket, grown_dims, is_dynamic, padded_args, scaled,
                                sizes_of, volume)


@pytest.mark.parametrize("size, planned", [(0, 1), (1, 1), (2, 2), (3, 4), (5, 8), (8, 8),
                                           (1025, 2048)])
def test_a_growing_dimension_is_planned_at_the_next_power_of_two(size: int, planned: int) -> None:
    assert bucket(size) == planned


def test_grown_dimensions_are_those_past_the_largest_call_of_the_same_structure() -> None:
    seen = [((4, 16), (4,)), ((8, 16), (8,)), ((100,),)]
    assert grown_dims(seen, ((12, 16), (12,))) == {(0, 0), (1, 0)}
    assert grown_dims(seen, ((6, 32), (6,))) == {(0, 1)}  # against the largest, (8, 16)
    assert grown_dims(seen, ((2, 16, 1),)) == set()  # no call of this structure yet
    assert grown_dims([], ((2,),)) == set()


def test_scaled_buckets_only_the_grown_dimensions() -> None:
    assert scaled(((12, 16), (12,)), {(0, 0)}) == ((16, 16), (12,))
    assert scaled(((12, 16),), {(0, 0), (0, 1)}, scale=2) == ((32, 32),)


def test_volume_and_sizes_of_count_tensor_inputs_only() -> None:
    assert volume(((2, 3), (4,), ())) == 6 + 4 + 1
    assert sizes_of((torch.ones(2, 3), 5, torch.ones(4))) == ((2, 3), (4,))
    assert not is_dynamic([torch.ones(1), 3])


def test_padded_args_are_zeros_or_fake_at_the_bucketed_sizes() -> None:
    x, mask = torch.ones(5, 3, requires_grad=True), torch.ones(5, 3, dtype=torch.bool)
    (args, kwargs) = padded_args((x,), {"mask": mask}, ((5, 3), (5, 3)), {(0, 0), (1, 0)})
    assert args[0].shape == (8, 3) and args[0].requires_grad and not args[0].any()
    assert kwargs["mask"].shape == (8, 3) and kwargs["mask"].dtype == torch.bool
    (fake,), _ = padded_args((x,), {}, ((5, 3),), {(0, 0)}, scale=2, fake=True)
    assert isinstance(fake, FakeTensor) and fake.shape == (16, 3)
    unchanged = padded_args((x, mask), {}, ((5, 3), (5, 3)), {(0, 0)})[0]
    assert unchanged[1] is mask  # nothing of it grew: the call's own tensor


def test_nothing_grown_or_a_key_of_another_structure_gives_no_placeholders() -> None:
    x = torch.ones(5, 3)
    assert padded_args((x,), {}, ((5, 3),), set()) is None
    assert padded_args((x,), {}, ((5, 3), (5,)), {(0, 0)}) is None


def test_growth_draws_a_line_through_one_plans_two_peaks() -> None:
    growth: Growth[str] = Growth()
    growth.saw("a", 100, 1_000 + 100 * 10)
    assert growth.fixed() is None and growth.predict("a", 200) is None
    growth.saw("b", 50, 99_999)  # another plan's peak does not make a line with a's
    growth.saw("a", 200, 1_000 + 200 * 10)
    growth.saw("a", 300, None)  # nothing verified: nothing noted
    assert growth.fixed() == 1_000
    assert growth.predict("a", 400) == 1_000 + 400 * 10
    assert growth.predict("c", 400) is None


def test_growth_keeps_the_latest_peaks_and_its_fixed_bytes_stay_within_them() -> None:
    growth: Growth[str] = Growth()
    for i in range(Growth.REMEMBERED + 4):
        growth.saw("a", 10 * (i + 1), 5)
    assert len(growth.points) == Growth.REMEMBERED and growth.points[0][1] == 50
    growth.saw("b", 10, 100)
    growth.saw("b", 20, 400)  # the line meets 0 below zero: fixed bytes are at least 0
    assert growth.fixed() == 0.0
