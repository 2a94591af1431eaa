"""The command line: ``fxckpt plan`` on a model factory in tests/, reports, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fxckpt
from fxckpt.__main__ import main

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


@pytest.fixture
def in_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run as a user would from the directory holding the model factory (``models:MLP``)."""
    pytest.importorskip("matplotlib").use("Agg")
    monkeypatch.chdir(TESTS)


def test_plan_prints_the_table_and_writes_a_report(
    in_tests, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "report"
    assert (
        main(
            [
                "plan",
                "models:MLP",
                "--input-shape",
                "8,32",
                "--every",
                "2",
                "--report",
                str(out),
                "--save",
                str(tmp_path / "export"),
            ]
        )
        == 0
    )
    stdout = capsys.readouterr().out
    assert (
        "segment_0" in stdout
        and "every=2" in stdout
        and f"report written to {out / 'index.html'}" in stdout
    )
    assert {p.name for p in out.iterdir()} >= {
        "plan.txt",
        "plan.json",
        "code.py",
        "graph.png",
        "memory.png",
        "pareto.png",
        "index.html",
    }
    plan = fxckpt.Plan.from_dict(json.loads((out / "plan.json").read_text()))
    assert len(plan.segments) == 3 and plan.signature == "(float32[8, 32])"
    page = (out / "index.html").read_text()
    assert (
        "<table>" in page
        and 'src="memory.png"' in page
        and "fxckpt_checkpoint(segment_0, x)" in page
    )
    assert fxckpt.load(tmp_path / "export").plan == plan
    import html

    # One summary, the plan's own figures, in the terminal, plan.txt and the page.
    text = (out / "plan.txt").read_text()
    assert stdout.splitlines()[0] == plan.summary() == text.splitlines()[0]
    assert html.escape(plan.summary()) in page


def test_plan_with_stages_draws_the_schedule(
    in_tests, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["plan", "models:MLP", "--input-shape", "8x32", "--budget", "0.6", "--chunks", "2",
                 "--devices", "cpu,cpu", "--report", str(tmp_path)]) == 0
    stdout = capsys.readouterr().out
    assert "pipeline: 2 stage(s)" in stdout
    assert (tmp_path / "schedule.png").stat().st_size > 1000 and not (
        tmp_path / "pareto.png"
    ).exists()
    plan = fxckpt.Plan.from_dict(json.loads((tmp_path / "plan.json").read_text()))
    assert plan.pipeline is not None and "per micro-batch" in stdout.splitlines()[0]
    page = (tmp_path / "index.html").read_text()
    assert page.count(plan.pipeline.schedule.splitlines()[0]) == 1  # stages shown once
    assert all(f"<td>{', '.join(s.modules)}</td>" in page for s in plan.pipeline.stages)


def test_budget_is_read_as_transform_reads_it(in_tests, capsys: pytest.CaptureFixture) -> None:
    from models import MLP

    assert main(["plan", "models:MLP", "--input-shape", "8,32", "--budget", "0.7"]) == 0
    printed = capsys.readouterr().out
    torch.manual_seed(0)  # the CLI's default --seed, for the model and then the input
    model = MLP()
    x = torch.randn(8, 32)
    plan = fxckpt.inspect(fxckpt.transform(model, budget=0.7, example_inputs=(x,))).plan
    assert plan.budget_bytes is not None and plan.budget_bytes == int(0.7 * plan.eager_peak_bytes)
    assert printed.splitlines()[0] == str(plan).splitlines()[0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["nosuch_pkg:make", "--input-shape", "8,32"], "no module named 'nosuch_pkg'"),
        (["models:make_nothing", "--input-shape", "8,32"], "has no attribute 'make_nothing'"),
        (["models:CASES", "--input-shape", "8,32"], "not a callable"),
        (["models", "--input-shape", "8,32"], "must look like package.module:callable"),
        (["models:MLP", "--input-shape", "8,x"], "--input-shape must be positive integers"),
        (
            ["models:MLP", "--input-shape", "8,32", "--budget", "2 lightyears"],
            "budget='2 lightyears' is not valid",
        ),
        (["models:MLP", "--input-shape", "8,32", "--budget", "1.5"], "in (0, 1]"),
        (
            ["models:MLP", "--input-shape", "8,32", "--budget", "1"],
            "budget='1' is ambiguous: as a number of bytes it is one byte",
        ),
        (["models:MLP", "--input-shape", "8,32", "--dtype", "float33"], "not a torch dtype"),
        (
            ["models:MLP", "--input-shape", "8,32", "--every", "0"],
            "every must be a positive integer",
        ),
        (
            ["models:MLP", "--input-shape", "8,32", "--every", "2", "--depth", "1"],
            "not allowed with argument --every",
        ),
        (["models:MLP"], "required: --input-shape"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(in_tests, argv: list[str], message: str,
                                                capsys: pytest.CaptureFixture) -> None:
    try:
        code = main(["plan", *argv])
    except SystemExit as e:  # argparse's own checks exit from inside parse_args
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err, err


TWO_INPUTS = """
import torch.nn as nn


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.fc = nn.Linear(16, 16)

    def forward(self, features, ids):
        return self.fc(features + self.emb(ids.view(-1, ids.shape[-1])))
"""


@pytest.mark.parametrize(
    "target, shapes, dtypes, message",
    [
        ("patterns:Tied", ["4,8"], [], "input 1 (--input-shape 4,8) is float32 but the model "
         "uses it as token ids (an embedding lookup needs integers); pass --dtype int64"),
        ("tagger_model:Tagger", ["4,8,16", "4,8"], [], "input 2 (--input-shape 4,8) is float32 "
         "but the model uses it as token ids (an embedding lookup needs integers); pass "
         "--dtype float32 --dtype int64"),
        ("tagger_model:Tagger", ["4,8,16", "4,8"], ["bfloat16"], "input 2 (--input-shape 4,8) "
         "is bfloat16 but the model uses it as token ids (an embedding lookup needs integers); "
         "pass --dtype bfloat16 --dtype int64"),
    ],
)
def test_float_token_ids_get_a_dtype_hint(
        in_tests, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
        target: str, shapes: list[str], dtypes: list[str], message: str) -> None:
    (tmp_path / "tagger_model.py").write_text(TWO_INPUTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["plan", target, "--every", "1"]
    argv += [a for s in shapes for a in ("--input-shape", s)]
    argv += [a for d in dtypes for a in ("--dtype", d)]
    assert main(argv) == 2
    assert capsys.readouterr().err == f"fxckpt plan: error: {message}\n"
    fixed = message.rpartition("pass ")[2].split()
    assert main([a for a in argv if a != "--dtype" and a not in dtypes] + fixed) == 0


def test_other_failures_keep_their_own_error(in_tests, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "models:MLP", "--input-shape", "8,31", "--every", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxckpt plan: error: ") and "--dtype" not in err and "31" in err


@pytest.mark.slow
def test_float_token_ids_of_a_hugging_face_model_get_the_hint(
        in_tests, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "models:gpt2", "--input-shape", "2,8", "--every", "1"]) == 2
    assert capsys.readouterr().err == (
        "fxckpt plan: error: input 1 (--input-shape 2,8) is float32 but the model uses it as "
        "token ids (an embedding lookup needs integers); pass --dtype int64\n")


def test_python_dash_m_fxckpt_reports_errors_without_a_traceback(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{TESTS}"}
    proc = subprocess.run(
        [sys.executable, "-m", "fxckpt", "plan", "models:MLP", "--input-shape", "0,32"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "fxckpt plan: error: --input-shape must be positive integers separated by commas, "
        "e.g. 8,3,224,224 (got '0,32')"
    ]
    help_text = subprocess.run(
        [sys.executable, "-m", "fxckpt", "plan", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    assert (
        "module:callable" in help_text and "--budget B" in help_text and "examples:" in help_text
    )


def test_every_subcommand_lives_in_cli() -> None:
    import fxckpt.__main__
    import fxckpt.cli

    assert fxckpt.__main__.main is fxckpt.cli.main
    parser = fxckpt.cli.build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert set(commands) == {"demo", "plan"}
