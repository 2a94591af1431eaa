"""Tests for fxckpt/cli/demo.py and the ``fxckpt`` command line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fxckpt
from fxckpt.__main__ import main
from fxckpt.cli.demo import GPT, QUICK, STRATEGIES, budget_lines, format_table

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # six fresh Python processes: about 15 s on an idle 2-core machine
def test_demo_quick_runs_and_checkpointing_lowers_measured_memory() -> None:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [sys.executable, "-m", "fxckpt", "demo", "--quick", "--threads", "1", "--jobs", "3"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {}
    for line in proc.stdout.splitlines():
        # strategy, plan peak, RSS peak and ratio, tracked peak and ratio, step time and ratio
        m = re.match(
            r"(\S+)\s+\S+ \S+\s+\S+ \S+\s+([\d.]+)x\s+\S+ \S+\s+([\d.]+)x\s+\d+ ms\s+([\d.]+)x$",
            line,
        )
        if m:
            rows[m.group(1)] = {
                "rss": float(m.group(2)),
                "tracked": float(m.group(3)),
                "time": float(m.group(4)),
            }
    assert set(rows) == set(STRATEGIES), proc.stdout
    assert rows["none"] == {"rss": 1.0, "tracked": 1.0, "time": 1.0}
    for name in ("every=2", "depth=2", "budget=0.5"):
        assert rows[name]["rss"] < 1.0, proc.stdout
        assert abs(rows[name]["rss"] - rows[name]["tracked"]) <= 0.05, (
            proc.stdout
        )  # two measures agree
    assert rows["budget=0.5"]["rss"] <= 0.5 * 1.05, proc.stdout  # the budget is kept
    assert re.search(r"^budget=0\.5: budget [\d.]+ [KM]iB \(0\.50x the unmodified plan peak\), "
                     r"plan peak [\d.]+ [KM]iB, measured peak [\d.]+ [KM]iB: within the budget$",
                     proc.stdout, re.MULTILINE), proc.stdout
    for name in STRATEGIES:  # a plan summary line per strategy above the table
        assert re.search(rf"^  {re.escape(name)} +\S", proc.stdout, re.MULTILINE), proc.stdout


def test_depth_2_makes_one_segment_per_block_and_keeps_gradients() -> None:
    torch.manual_seed(0)
    model = GPT(QUICK).train()
    idx = torch.randint(QUICK.vocab, (2, QUICK.seq))
    tm = fxckpt.transform(model, depth=2, example_inputs=(idx,))
    assert fxckpt.inspect(tm).plan.capture == "symbolic_trace"
    assert [s.module_paths for s in fxckpt.inspect(tm).plan.segments] == [
        (f"blocks.{i}",) for i in range(QUICK.layers)
    ]

    grads: list[list[torch.Tensor]] = []
    for m in (model, tm):
        torch.manual_seed(1)  # same dropout masks
        model.zero_grad()
        F.cross_entropy(m(idx).flatten(0, 1), idx.flatten()).backward()
        grads.append(
            [torch.zeros(0) if p.grad is None else p.grad.clone() for p in model.parameters()]
        )
    assert all(a.numel() > 0 and torch.equal(a, b) for a, b in zip(*grads))


def test_format_table_aligns_and_divides_by_the_first_row() -> None:
    rows = [
        {
            "strategy": "none",
            "plan_bytes": 2**20 * 90,
            "rss_bytes": 2**20 * 100,
            "tracked_bytes": 2**20 * 100,
            "seconds": 0.5,
        },
        {
            "strategy": "every=2",
            "plan_bytes": 2**20 * 38,
            "rss_bytes": 2**20 * 40,
            "tracked_bytes": 2**20 * 41,
            "seconds": 0.75,
        },
    ]
    lines = format_table(rows).splitlines()
    assert len(lines) == 3 and len({len(line) for line in lines}) == 1
    assert lines[0].split()[:3] == ["strategy", "plan", "peak"]
    assert lines[2].split() == [
        "every=2",
        "38.0",
        "MiB",
        "40.0",
        "MiB",
        "0.40x",
        "41.0",
        "MiB",
        "0.41x",
        "750",
        "ms",
        "1.50x",
    ]


def test_format_table_shows_a_missing_tracker_count_as_n_a() -> None:
    rows = [
        {"strategy": "none", "rss_bytes": 2**20, "tracked_bytes": None, "seconds": 0.5},
        {"strategy": "every=2", "rss_bytes": 2**19, "tracked_bytes": 2**19, "seconds": 0.5},
    ]
    lines = format_table(rows).splitlines()
    assert lines[1].split() == ["none", "n/a", "1.0", "MiB", "1.00x", "n/a", "n/a", "500", "ms",
                                "1.00x"]
    assert lines[2].split() == ["every=2", "n/a", "512.0", "KiB", "0.50x", "512.0", "KiB", "n/a",
                                "500", "ms", "1.00x"]


def test_budget_lines_say_whether_the_measured_peak_kept_the_budget() -> None:
    rows = [
        {"strategy": "none", "plan_bytes": 2**20 * 10, "rss_bytes": 2**20 * 11},
        {"strategy": "depth=2", "plan_bytes": 2**20 * 3, "rss_bytes": 2**20 * 3},
        {"strategy": "budget=0.5", "plan_bytes": 2**20 * 4, "budget_bytes": 2**20 * 5,
         "rss_bytes": 2**20 * 4},
        {"strategy": "budget=0.2", "plan_bytes": 2**20 * 2, "budget_bytes": 2**20 * 2,
         "rss_bytes": 2**20 * 3},
    ]
    assert budget_lines(rows) == [
        "budget=0.5: budget 5.0 MiB (0.50x the unmodified plan peak), plan peak 4.0 MiB, "
        "measured peak 4.0 MiB: within the budget",
        "budget=0.2: budget 2.0 MiB (0.20x the unmodified plan peak), plan peak 2.0 MiB, "
        "measured peak 3.0 MiB: OVER the budget",
    ]


@pytest.mark.parametrize("argv", [[], ["demo", "--repeats", "0"], ["plan"]])
def test_cli_rejects_bad_arguments(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err  # one line: what was wrong, and where --help is
    assert (
        err.startswith("fxckpt")
        and "error:" in err
        and "--help" in err
        and len(err.strip().splitlines()) == 1
    )
