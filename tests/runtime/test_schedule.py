"""runtime/schedule.py: the GPipe fill-drain clocks, its bubble, which micro-batches recompute,
and the chart ``describe()`` prints."""

from __future__ import annotations

import pytest

from fxckpt.errors import ConfigError
from fxckpt.runtime.schedule import (bubble_fraction, checkpoint_stop, clock_cycles,
                                     schedule_chart)


def test_micro_batch_i_runs_on_stage_j_at_clock_i_plus_j() -> None:
    clocks = list(clock_cycles(4, 3))
    assert len(clocks) == 4 + 3 - 1
    assert clocks[0] == [(0, 0)] and clocks[2] == [(2, 0), (1, 1), (0, 2)]
    assert clocks[-1] == [(3, 2)]
    pairs = [pair for clock in clocks for pair in clock]
    assert sorted(pairs) == [(i, j) for i in range(4) for j in range(3)]
    assert all(i + j == k for k, clock in enumerate(clocks) for i, j in clock)


def test_one_stage_runs_one_micro_batch_a_clock() -> None:
    assert list(clock_cycles(3, 1)) == [[(0, 0)], [(1, 0)], [(2, 0)]]
    assert list(clock_cycles(1, 2)) == [[(0, 0)], [(0, 1)]]


def test_the_bubble_is_k_minus_1_over_m_plus_k_minus_1() -> None:
    assert bubble_fraction(4, 3) == pytest.approx(2 / 6)
    assert bubble_fraction(8, 1) == 0.0
    assert bubble_fraction(1, 4) == pytest.approx(3 / 4)


@pytest.mark.parametrize("mode, stop", [("always", 5), ("except_last", 4), ("never", 0)])
def test_checkpoint_stop_follows_torchgpipe(mode: str, stop: int) -> None:
    assert checkpoint_stop(5, mode) == stop


def test_an_unknown_checkpoint_mode_is_a_key_error() -> None:
    with pytest.raises(KeyError):
        checkpoint_stop(5, "sometimes")


@pytest.mark.parametrize("call", [lambda: list(clock_cycles(2, 0)),
                                  lambda: bubble_fraction(0, 2),
                                  lambda: schedule_chart(2, 1.5)])
def test_chunks_and_stages_must_be_positive_integers(call) -> None:
    with pytest.raises(ConfigError, match="must be a positive integer"):
        call()


def test_the_chart_marks_the_micro_batches_that_recompute() -> None:
    chart = schedule_chart(4, 3, recompute_stop=3).splitlines()
    assert chart[0] == ("GPipe fill-drain: 4 micro-batch(es) x 3 stage(s), 6 clocks, "
                        "bubble (K-1)/(M+K-1) = 2/6 = 33%")
    assert chart[1].split() == ["clock", "0", "1", "2", "3", "4", "5"]
    assert chart[2].split() == ["stage", "0", "0*", "1*", "2*", "3", ".", "."]
    assert chart[4].split() == ["stage", "2", ".", ".", "0*", "1*", "2*", "3"]
    assert chart[-1] == "* = checkpointed: recomputed in backward"


def test_an_unmarked_chart_has_no_stars_and_no_legend() -> None:
    for stop in (None, 0):
        chart = schedule_chart(2, 2, recompute_stop=stop)
        assert "*" not in chart and len(chart.splitlines()) == 4
