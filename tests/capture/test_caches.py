"""capture/caches.py: the functools caches a model's code fills while fxckpt runs it on fake
tensors are emptied, so no fake tensor outlives the run."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

from fxckpt.capture.caches import caches_kept, lru_caches


@functools.lru_cache(maxsize=None)
def _table(n: int) -> torch.Tensor:
    return torch.arange(float(n))


@functools.lru_cache(maxsize=None)
def _unused(n: int) -> int:
    return n


def _decorated(fn):  # type: ignore[no-untyped-def]
    cached = functools.lru_cache(maxsize=2)(fn)

    @functools.wraps(fn)
    def wrapper(*args):  # type: ignore[no-untyped-def]
        return cached(*args)

    return wrapper


class Tables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    @staticmethod
    @_decorated
    def index(n: int) -> torch.Tensor:
        return torch.arange(n).flip(0)

    @classmethod
    @functools.lru_cache(maxsize=2)
    def scale(cls, n: int) -> torch.Tensor:
        return torch.full((n,), 0.5)

    @property
    @functools.lru_cache(maxsize=2)
    def ones(self) -> torch.Tensor:
        return torch.ones(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)[..., self.index(4)] * _table(4) * self.scale(4) * self.ones


def _names(caches: list) -> set[str]:
    return {c.__qualname__ for c in caches}


def test_caches_are_found_behind_methods_decorators_and_module_functions() -> None:
    names = _names(lru_caches(Tables()))
    assert {"Tables.index", "Tables.scale", "Tables.ones", "_table", "_unused"} <= names
    assert lru_caches(nn.Linear(2, 2)) == []  # torch's own classes are not walked


def test_a_cache_filled_on_fake_tensors_is_emptied_and_real_calls_stay_real() -> None:
    model = Tables()
    _table.cache_clear()
    _unused(1)  # filled before: kept
    with caches_kept(model), FakeTensorMode(allow_non_fake_inputs=True):
        out = model(torch.randn(2, 4))
    assert is_fake(out)
    assert _table.cache_info().currsize == 0 and _unused.cache_info().currsize == 1
    real = model(torch.randn(2, 4))
    assert not is_fake(real) and not is_fake(Tables.index(4)) and not is_fake(_table(4))
    with caches_kept(model):  # hits only: nothing is emptied
        model(torch.randn(2, 4))
    assert _table.cache_info().currsize == 1
