"""strategy.py: transform's strategy keywords become one small frozen type, and two of them at
once are refused by name."""

from __future__ import annotations

import dataclasses

import pytest

from fxckpt.budget import Budget
from fxckpt.errors import ConfigError
from fxckpt.strategy import Budgeted, Depth, Every, Replay, strategy_from
from handmade import plan


def test_each_keyword_names_its_strategy() -> None:
    saved = plan()
    assert strategy_from(every=2) == Every(units=2)
    assert strategy_from(depth=3) == Depth(depth=3)
    assert strategy_from(budget=Budget(bytes=64)) == Budgeted(budget=Budget(bytes=64))
    assert strategy_from(plan=saved) == Replay(plan=saved)
    assert strategy_from() is None


def test_names_and_reasons_say_what_made_a_segment() -> None:
    assert [(s.name, s.reason()) for s in (Every(2), Depth(3), Budgeted(Budget(fraction=0.5)),
                                           Replay(plan()))] == [
        ("every", "every=2"),
        ("depth", "depth=3"),
        ("budget", "budget: least recompute under the peak"),
        ("replay", "replayed from a saved plan"),
    ]


def test_strategies_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Every(2).units = 3


@pytest.mark.parametrize("make, message", [
    (lambda: Every(0), "every must be a positive integer (got 0)"),
    (lambda: Every(True), "every must be a positive integer (got True)"),
    (lambda: Depth(1.5), "depth must be a positive integer (got 1.5)"),
])
def test_counts_are_positive_integers(make, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        make()
    assert str(caught.value) == message


def test_two_strategies_are_refused_naming_both() -> None:
    with pytest.raises(ConfigError) as caught:
        strategy_from(every=2, budget=Budget(fraction=0.5), plan=plan())
    assert str(caught.value) == ("give at most one strategy, got every=2 and budget=0.5 of the "
                                 "eager peak and plan=<Plan>; choose one of them")
    with pytest.raises(ConfigError, match="got depth='x' and budget=64 bytes;"):
        strategy_from(depth="x", budget=Budget(bytes=64))
