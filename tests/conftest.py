import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True)
def seed() -> int:
    """Every test starts from the same RNG state."""
    torch.manual_seed(1234)
    return 1234
