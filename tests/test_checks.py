"""fxckpt.checks: one wording for every integer/number argument, wherever it enters fxckpt."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from fxckpt.checks import check_int, check_number, is_int
from fxckpt.errors import ConfigError
from fxckpt.measure import time_step
from fxckpt.runtime.microbatch import scatter
from fxckpt.runtime.schedule import bubble_fraction, clock_cycles


def test_is_int_refuses_bools_and_floats() -> None:
    assert is_int(3) and is_int(0) and is_int(-2)
    assert not is_int(True) and not is_int(2.0) and not is_int("2")


@pytest.mark.parametrize("value,options,message", [
    (0, {}, "n must be a positive integer (got 0)"),
    (True, {}, "n must be a positive integer (got True)"),
    (2.0, {}, "n must be a positive integer (got 2.0)"),
    (-1, {"low": 0}, "n must be a non-negative integer (got -1)"),
    (5, {"low": 0, "high": 4}, "n must be an integer in [0, 4] (got 5)"),
    (1, {"low": 2}, "n must be an integer >= 2 (got 1)"),
    (-1, {"low": 0, "unit": "of bytes"}, "n must be a non-negative integer of bytes (got -1)"),
])
def test_check_int_states_the_rule_and_the_value(value: object, options: dict,
                                                 message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        check_int("n", value, **options)
    assert str(caught.value) == message
    assert isinstance(caught.value, ValueError)


def test_check_int_returns_the_value_and_takes_an_error_class() -> None:
    assert check_int("n", 3) == 3
    assert check_int("n", 0, low=0, high=0) == 0

    class OtherError(ConfigError):
        pass

    with pytest.raises(OtherError, match=r"^n must be a positive integer \(got 0\)$"):
        check_int("n", 0, error=OtherError)


@pytest.mark.parametrize("value,options,message", [
    (0, {"strict": True}, "x must be a positive number (got 0)"),
    (float("nan"), {}, "x must be a >= 0 number (got nan)"),
    (float("inf"), {}, "x must be a >= 0 number (got inf)"),
    (False, {}, "x must be a >= 0 number (got False)"),
    ("1", {}, "x must be a >= 0 number (got '1')"),
    (0.5, {"low": 1, "unit": "of bytes/s"}, "x must be a >= 1 number of bytes/s (got 0.5)"),
])
def test_check_number_states_the_rule_and_the_value(value: object, options: dict,
                                                    message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        check_number("x", value, **options)
    assert str(caught.value) == message
    assert check_number("x", 2) == 2.0 and isinstance(check_number("x", 2), float)


BAD_CALLS: list[tuple[Callable[[], object], str]] = [
    (lambda: list(clock_cycles(0, 2)), "chunks must be a positive integer (got 0)"),
    (lambda: bubble_fraction(2, True), "stages must be a positive integer (got True)"),
    (lambda: scatter((torch.randn(4),), {}, 1.5), "chunks must be a positive integer (got 1.5)"),
    (lambda: time_step(lambda: None, repeats=0), "repeats must be a positive integer (got 0)"),
]


@pytest.mark.parametrize("call,message", BAD_CALLS)
def test_call_sites_use_the_shared_wording(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        call()
    assert str(caught.value) == message


def test_show_checks_max_nodes_before_anything_else() -> None:
    pytest.importorskip("matplotlib")
    import fxckpt

    with pytest.raises(ConfigError, match=r"^max_nodes must be a positive integer \(got 0\)$"):
        fxckpt.show(object(), max_nodes=0)
