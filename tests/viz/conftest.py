"""The two transformed MLPs the picture tests draw (tests/viz/test_*.py): one plain, one in two
pipeline stages, made once for all of them."""

from __future__ import annotations

import pytest

import fxckpt
from models import MLP
from .viz_support import X


@pytest.fixture(scope="session")
def plain() -> fxckpt.TransformedModule:
    return fxckpt.transform(MLP(), every=2, example_inputs=(X,))


@pytest.fixture(scope="session")
def staged() -> fxckpt.TransformedModule:
    return fxckpt.transform(MLP(), every=2, chunks=2, devices=["cpu", "cpu"], example_inputs=(X,))
