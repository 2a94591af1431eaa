"""Each test of the Dynamo path starts from empty Dynamo caches.

Dynamo keeps compiled code per code object: a transformed module compiles its own copy of the
model's forward, but frames Dynamo resumes in after a graph break, and those of functions it
cannot inline, are the library's or the model class's and are shared by every instance. Hundreds
of transforms of the same classes in one test session would reach Dynamo's recompile limit on
them (a training job holds one or a few).
"""

from __future__ import annotations

from typing import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
