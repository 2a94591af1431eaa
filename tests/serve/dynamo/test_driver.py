"""serve/dynamo/driver.py: the driver's own bookkeeping, without running Dynamo: a forward of
its own code object to compile, the settings calls compile under, the budget a graph is left
with, and which graph stands for the step. Calls through Dynamo: tests/dynamo/test_driver.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from fxckpt.budget import Budget
from fxckpt.config import TransformConfig
from fxckpt.serve.dynamo.driver import GUARDS, DynamoDriver, _device_of, _own_copy
from fxckpt.strategy import Budgeted, Every
from handmade import Tiny


def _driver(config: TransformConfig) -> DynamoDriver:
    return DynamoDriver(Tiny(), config)  # compiles nothing until it is called


def _plan(nodes: int = 1, verified: int | None = 100, budget: int = 500) -> SimpleNamespace:
    return SimpleNamespace(node_count=nodes, verified_peak=verified, budget_bytes=budget)


def test_each_driver_compiles_a_forward_of_its_own_code_object() -> None:
    def forward(self, x, *, scale=2):
        """Doc."""
        return x * scale

    forward.marker = "kept"
    copy = _own_copy(forward)
    assert copy.__code__ is not forward.__code__ and copy.__code__ == forward.__code__
    assert (copy.__name__, copy.__qualname__, copy.__doc__, copy.marker) == (
        "forward", forward.__qualname__, "Doc.", "kept")
    assert copy.__kwdefaults__ == {"scale": 2} and copy(None, 3) == 6
    driver = _driver(TransformConfig(strategy=Every(1)))
    assert driver.model_forward is Tiny.forward and driver.compiles == 0 and driver.records == []


def test_the_device_is_the_first_parameters_or_cpu() -> None:
    assert _device_of(torch.nn.Linear(2, 2, device="meta")) == "meta"
    assert _device_of(torch.nn.ReLU()) == "cpu"


def test_the_dynamo_settings_are_a_copy_per_driver() -> None:
    driver = _driver(TransformConfig(strategy=Every(1)))
    assert driver.guards == GUARDS and driver.guards is not GUARDS
    driver.guards = {"allow_unspec_int_on_nn_module": False}
    assert driver.guards == {"allow_unspec_int_on_nn_module": False}
    assert GUARDS["allow_unspec_int_on_nn_module"] is True


def test_a_graph_is_left_the_budget_less_what_the_step_keeps_and_reserves() -> None:
    driver = _driver(TransformConfig(strategy=Budgeted(Budget(bytes=1000))))
    assert driver.leftover(_plan()) == 1000
    driver.step = [SimpleNamespace(held_bytes=300), SimpleNamespace(held_bytes=200)]
    driver.reserves = {2: 100}  # room kept for the graphs after the third
    assert driver.leftover(_plan()) == 400
    driver.reserves = {2: 10_000}
    assert driver.leftover(_plan()) == 1
    assert driver.leftover(_plan(verified=None)) is None


def test_a_fraction_leaves_the_plan_its_own_budget_and_no_budget_none() -> None:
    fraction = _driver(TransformConfig(strategy=Budgeted(Budget(fraction=0.5))))
    assert fraction.leftover(_plan(budget=777)) == 777
    assert _driver(TransformConfig(strategy=Every(1))).leftover(_plan()) is None


def test_the_steps_largest_graph_stands_for_it() -> None:
    driver = _driver(TransformConfig(strategy=Every(1)))
    assert driver.last is None
    small, large = SimpleNamespace(plan=_plan(nodes=3)), SimpleNamespace(plan=_plan(nodes=9))
    driver.records = [small, large]
    assert driver.last is large  # before any call ran: every graph planned
    driver._ran(small)
    assert driver.step == [small] and driver.last is small
