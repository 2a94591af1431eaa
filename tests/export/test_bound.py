"""export/bound.py: what a loaded graph may allocate, measured by one training step on fake
tensors at its saved example shapes, and refused past its limit."""

from __future__ import annotations

import pytest
import torch
import torch.fx

from fxckpt.export import ExportError
from fxckpt.export.bound import (EXAMPLE, FLOOR, check_saved, check_step, example_from,
                                 fake_step, input_bytes, saved_examples)


def test_a_saved_example_is_a_shape_of_ints_and_a_known_dtype() -> None:
    assert example_from({"shape": [2, 3], "dtype": "float32"}, "x") == {
        "shape": [2, 3], "dtype": "float32", "grad": False}
    assert example_from({"shape": [], "dtype": "int64", "grad": True}, "x")["grad"] is True


@pytest.mark.parametrize("data", [None, {"shape": [2], "dtype": "pickle"},
                                  {"shape": [-1], "dtype": "float32"},
                                  {"shape": [2 ** 48], "dtype": "float32"},
                                  {"shape": [True], "dtype": "float32"},
                                  {"shape": [1] * 17, "dtype": "float32"},
                                  {"shape": [1], "dtype": "float32", "grad": 1}])
def test_any_other_example_is_refused(data: object) -> None:
    with pytest.raises(ExportError, match="^node 'x': a placeholder's example must be a shape"):
        example_from(data, "node 'x'")


def test_input_bytes_counts_tensors() -> None:
    assert input_bytes((torch.ones(2, 3), [torch.ones(4, dtype=torch.float16)], 7, None)) == 32


def test_input_bytes_counts_the_examples_standing_for_tensors() -> None:
    """A saved example is a dict: counted whole, not flattened into its shape's numbers (a
    loaded module's input growth is measured against these bytes, export/loaded.py)."""
    assert input_bytes(({"shape": [4], "dtype": "float16"},)) == 8
    assert input_bytes(({"x": {"shape": [2, 3], "dtype": "float32", "grad": False}},
                        torch.zeros(5))) == 24 + 20


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(256, 256)

    def forward(self, x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return torch.relu(self.fc(x)) * scale


def _traced(shape: list[int]) -> torch.fx.GraphModule:
    gm = torch.fx.symbolic_trace(Net())
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    x.meta[EXAMPLE] = {"shape": shape, "dtype": "float32", "grad": False}
    return gm


def test_saved_examples_stand_for_tensors_and_defaults_for_the_rest() -> None:
    assert saved_examples(_traced([4, 256])) == (
        {"shape": [4, 256], "dtype": "float32", "grad": False}, 2.0)


def test_a_fake_step_measures_the_activations_without_allocating_them() -> None:
    gm = _traced([1024, 256])
    peak = check_saved(gm, stated=None, limit=None, where="segment_0")
    assert 1024 * 256 * 4 <= peak <= 8 * 1024 * 256 * 4  # a 1 MiB activation, a few held
    assert gm.fc.weight.grad is None  # nothing real ran


def test_a_step_past_its_limit_is_refused_naming_the_limit() -> None:
    with pytest.raises(ExportError, match=r"^segment_0: one training step of its graph "
                                          r"allocates \d+ bytes on fake tensors, over the limit "
                                          r"of 1000 bytes"):
        check_saved(_traced([1024, 256]), stated=None, limit=1000, where="segment_0")


def test_the_default_limit_grows_with_the_stated_peak_and_the_input_above_a_floor() -> None:
    gm = _traced([1 << 16, 256])  # a 64 MiB input: a step over the floor
    with pytest.raises(ExportError, match=f"over the limit of {FLOOR} bytes"):
        check_saved(gm, stated=1, limit=None, where="g")
    peak = check_saved(gm, stated=None, limit=1 << 40, where="g")
    stated = peak // 8 + 1  # 4x of it is under the peak, 4x grown twice is over it

    def run(values: tuple) -> torch.Tensor:
        return torch.fx.Interpreter(gm).run(*values, enable_io_processing=False)

    with pytest.raises(ExportError, match=f"over the limit of {4 * stated} bytes"):
        check_step(gm, run, saved_examples(gm), stated=stated, growth=1.0, limit=None, where="g")
    assert check_step(gm, run, saved_examples(gm), stated=stated, growth=2.0, limit=None,
                      where="g") == peak


def test_a_graph_that_fails_on_fake_tensors_is_refused() -> None:
    with pytest.raises(ExportError, match=r"^g: its graph does not run on fake tensors at the "
                                          r"shapes it was saved for.*\(RuntimeError: "):
        check_saved(_traced([4, 3]), stated=None, limit=None, where="g")


def test_a_data_dependent_size_is_counted_at_its_largest() -> None:
    x = torch.ones(1 << 10)
    peak = fake_step(torch.nn.Module(), lambda args: args[0][args[0] > 0] * 2,
                     (x.requires_grad_(),))
    assert peak >= 2 * x.numel() * 4  # the selection and its double, every element counted
