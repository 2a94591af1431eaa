"""budget= accepts fractions, bytes and sizes with units, and rejects everything else clearly."""

from __future__ import annotations

import math
import re

import pytest

import fxckpt

from fxckpt.budget import Budget, parse_budget
from fxckpt.errors import ConfigError
from models import MLP


@pytest.mark.parametrize(
    "value,expected",
    [
        (0.4, Budget(fraction=0.4)),
        (1.0, Budget(fraction=1.0)),
        (1024, Budget(bytes=1024)),
        ("800MB", Budget(bytes=800_000_000)),
        ("1.5GiB", Budget(bytes=int(1.5 * 2**30))),
        ("512 KiB", Budget(bytes=512 * 1024)),
        ("2g", Budget(bytes=2 * 2**30)),
        ("4096", Budget(bytes=4096)),
        ("2_000_000", Budget(bytes=2_000_000)),
        # a unitless string means what the same number means in Python (config files, the CLI)
        ("0.5", Budget(fraction=0.5)),
        (" 0.25 ", Budget(fraction=0.25)),
        ("1.0", Budget(fraction=1.0)),
        (".4", Budget(fraction=0.4)),
        ("2", Budget(bytes=2)),
        ("1b", Budget(bytes=1)),  # a unit makes one byte explicit
    ],
)
def test_accepted(value: object, expected: Budget) -> None:
    assert parse_budget(value) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value,why",
    [
        (0, "a byte count must be positive"),
        (-5, "a byte count must be positive"),
        (0.0, "a float budget is a fraction of the eager peak, in (0, 1]"),
        (-0.5, "a float budget is a fraction of the eager peak, in (0, 1]"),
        (1.5, "a float budget is a fraction of the eager peak, in (0, 1]"),
        (math.nan, "a float budget is a fraction of the eager peak, in (0, 1]"),
        ("12 parsecs", "cannot read it as a number with a unit"),
        ("-3GB", "a size must be positive"),
        ("GB", "cannot read it as a number with a unit"),
        (True, "a bool is not a budget"),
        ([1], "a list is not a budget"),
        ("1.5", "a float budget is a fraction of the eager peak, in (0, 1]"),
        ("1e9", "a float budget is a fraction of the eager peak, in (0, 1]"),
        ("nan", "a float budget is a fraction of the eager peak, in (0, 1]"),
        ("0", "a byte count must be positive"),
        ("-5", "a byte count must be positive"),
        ("0.5b", "it is less than one byte"),
        ("", "cannot read it as a number with a unit"),
    ],
)
def test_rejected_with_the_value_and_the_accepted_forms(value: object, why: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_budget(value)  # type: ignore[arg-type]
    text = str(e.value)
    assert f"budget={value!r} is not valid: {why}" in text
    assert "'1.5GiB'" in text and "(0, 1]" in text


def test_fraction_resolves_against_the_eager_peak() -> None:
    assert parse_budget(0.25).resolve(1000) == 250
    assert parse_budget("1KiB").resolve(10**9) == 1024


@pytest.mark.parametrize("value", [1, "1", " 1 "])
def test_one_is_refused_as_ambiguous_with_both_readings(value: object) -> None:
    with pytest.raises(ConfigError) as e:
        parse_budget(value)  # type: ignore[arg-type]
    assert str(e.value).startswith(f"budget={value!r} is ambiguous: as a number of bytes")
    assert "Write 1.0 for the whole peak activation memory" in str(e.value)
    assert "'1GiB'" in str(e.value)


@pytest.mark.parametrize(
    "value,message",
    [
        (1, "budget=1 is ambiguous"),
        ("0.5b", "budget='0.5b' is not valid: it is less than one byte"),
        ("1.5", "budget='1.5' is not valid: a float budget is a fraction"),
        ("12 parsecs", "budget='12 parsecs' is not valid"),
    ],
)
def test_a_bad_budget_fails_at_transform_time(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        fxckpt.transform(MLP(), budget=value)  # type: ignore[arg-type]


def test_a_string_fraction_is_the_same_budget_as_the_float() -> None:
    tm = fxckpt.transform(MLP(), budget="0.5")
    assert fxckpt.inspect(tm).config.budget == Budget(fraction=0.5)
