"""capture/own_error.py: what the model's own forward raises for a call fxckpt could not
capture, found without changing the model's state; no answer when finding it would."""

from __future__ import annotations

import pytest
import torch

from fxckpt.capture.own_error import own_error


class Picky(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        self.register_buffer("ema", torch.zeros(2))
        self.calls = 0

    def forward(self, x: torch.Tensor, update: bool = False) -> torch.Tensor:
        self.calls += 1
        if update:
            self.ema.add_(1.0)
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"x must be a tensor, got {type(x).__name__}")
        return self.fc(x)


def test_the_models_own_refusal_is_the_answer() -> None:
    model = Picky()
    error = own_error(model, ([torch.ones(2)],), {})
    assert isinstance(error, ValueError) and str(error) == "x must be a tensor, got list"
    missing = own_error(model, (), {})
    assert isinstance(missing, TypeError) and "missing 1 required positional argument" in \
        str(missing)


def test_a_call_the_model_accepts_has_no_answer() -> None:
    assert own_error(Picky(), (torch.ones(3, 2),), {}) is None


def test_asking_leaves_attributes_as_they_were() -> None:
    model = Picky()
    own_error(model, ([torch.ones(2)],), {})
    assert model.calls == 0


def test_a_write_to_a_buffer_gives_up_before_it_happens() -> None:
    model = Picky()
    assert own_error(model, ([torch.ones(2)],), {"update": True}) is None
    assert torch.equal(model.ema, torch.zeros(2))


def test_what_a_meta_tensor_cannot_do_is_not_the_models_answer() -> None:
    class Reads(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * x.sum().item()

    with pytest.raises(RuntimeError):  # eager on meta: the same error the probe sees
        Reads()(torch.ones(2, device="meta"))
    assert own_error(Reads(), (torch.ones(2, device="meta"),), {}) is None
