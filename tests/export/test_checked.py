"""export/checked.py: ``aten._weight_norm`` called by loaded graphs through the check of ``g``'s
shape its kernel lacks."""

from __future__ import annotations

import pytest
import torch

from fxckpt.export.checked import CHECKED, weight_norm


def test_a_well_formed_call_is_the_kernels_result() -> None:
    v, g = torch.randn(3, 4), torch.rand(3, 1) + 0.5
    expected = torch.ops.aten._weight_norm.default(v, g, 0)
    assert torch.equal(weight_norm(v, g, 0), expected)


def _g(v: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.ones([v.size(i) if i == dim else 1 for i in range(v.dim())])


def test_dim_minus_one_takes_a_single_element_g() -> None:
    v = torch.randn(3, 4)
    assert torch.equal(weight_norm(v, torch.tensor(2.0), -1),
                       torch.ops.aten._weight_norm.default(v, torch.tensor(2.0), -1))
    with pytest.raises(ValueError, match="does not match v of shape"):
        weight_norm(v, torch.ones(3), -1)


@pytest.mark.parametrize("g", [torch.ones(0), torch.ones(4, 1), torch.ones(3, 1).double()])
def test_a_g_the_kernel_would_misread_is_refused(g: torch.Tensor) -> None:
    with pytest.raises(ValueError, match=r"^_weight_norm: g of shape .* does not match v of "
                                         r"shape \(3, 4\) along dim 0$"):
        weight_norm(torch.randn(3, 4), g, 0)


def test_arguments_of_the_wrong_kind_or_range_are_refused() -> None:
    v = torch.randn(3, 4)
    with pytest.raises(TypeError, match="takes two tensors and an int"):
        weight_norm(v, _g(v, 0), True)
    with pytest.raises(TypeError, match="takes two tensors and an int"):
        weight_norm(v, [1.0], 0)
    with pytest.raises(IndexError, match="^_weight_norm: dim 2 is out of range for 2 dimensions$"):
        weight_norm(v, _g(v, 0), 2)


def test_a_negative_dim_other_than_minus_one_is_counted_from_the_end() -> None:
    v = torch.randn(3, 4)
    assert torch.equal(weight_norm(v, _g(v, 0), -2), weight_norm(v, _g(v, 0), 0))
    with pytest.raises(IndexError, match="dim -3 is out of range"):
        weight_norm(v, _g(v, 0), -3)


def test_the_allowlist_name_maps_to_the_checked_function() -> None:
    assert CHECKED == {"torch.ops.aten._weight_norm.default": weight_norm}
