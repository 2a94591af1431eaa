"""The calibration script measures every tuned cost constant in the code's own unit."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.calibrate import OPS, main, measure, render
from fxckpt.cost import prices
from fxckpt.cost.bridge import KEEP_COST, SAVED_COST, SEGMENT_COST


def test_every_constant_is_measured_beside_its_value_in_the_code() -> None:
    result = measure(repeats=2)
    rows = {r["name"]: r for r in result["rows"]}
    assert len(rows) == 1 + len(OPS) + 3
    assert rows["SEGMENT_COST"]["code"] == SEGMENT_COST
    assert rows["KEEP_COST"]["code"] == KEEP_COST
    assert rows["SAVED_COST"]["code"] == SAVED_COST
    assert rows["CALL_PRICE"]["code"] == prices.CALL_PRICE
    assert rows["CPU_PRICES['gelu']"]["code"] == prices.CPU_PRICES["gelu"]
    assert rows["GELU_TANH_PRICE"]["code"] == prices.GELU_TANH_PRICE
    # a draw is measured alone (p = 1) and at one half, both beside the table's one price
    assert rows["RANDOM_PRICE"]["code"] == prices.RANDOM_PRICE
    assert rows["RANDOM_PRICE (p = 0.5)"]["code"] == prices.RANDOM_PRICE
    assert "bernoulli_ at p = 0.5" in rows["RANDOM_PRICE (p = 0.5)"]["how"]
    assert result["rate"] > 1e8  # a 1024^3 matmul: far above 0.1 GFLOP/s on any CPU
    # a 1 MiB tanh writes at a price between a copy's and a million FLOPs a byte
    assert 0.1 < rows["CPU_PRICES['tanh']"]["measured"] < 1e6
    assert rows["SEGMENT_COST"]["measured"] > 0  # 32 segments cost more than none
    # 160 saved tensors' hooks: above a call's price, below a millisecond each
    assert prices.CALL_PRICE < rows["SAVED_COST"]["measured"] < 1e-3 * result["rate"]
    text = render(result)
    assert "| `SEGMENT_COST` | 3e+07 |" in text and text.count("\n| `") == len(rows)


def test_bad_repeats_are_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--repeats", "0", "--out", str(tmp_path)])
    assert "--repeats must be positive (got 0)" in capsys.readouterr().err
