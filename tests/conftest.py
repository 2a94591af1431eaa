import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# Plans for CPU models are priced with fxckpt's price table, not with prices measured on this
# machine (fxckpt.cost.cpu_table): the same plans on every machine, in every process the tests
# start. tests/cost/test_cpu_table.py turns the measured prices on where it tests them.
os.environ["FXCKPT_CPU_PRICES"] = "table"

# Under pytest-xdist (``-n 2``) each worker takes one of the machine's cores: torch's own
# intra-op threads on top would oversubscribe them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def seed() -> int:
    """Every test starts from the same RNG state."""
    torch.manual_seed(1234)
    return 1234


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow tier (:mod:`tiers`): marked here, so ``-m slow`` and ``-m "not slow"`` split it."""
    from tiers import is_slow

    for item in items:  # node ids are relative to the repository (pyproject.toml's directory)
        if is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)
