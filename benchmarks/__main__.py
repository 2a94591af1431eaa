"""Command line: ``python -m benchmarks [--quick] [--models mlp,resnet,...] [--budgets ...]``."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence, TypeVar

from fxckpt.cli import positive_int

if TYPE_CHECKING:
    from benchmarks.runner import BenchOptions

__all__ = ["main", "build_parser", "options_from"]

T = TypeVar("T")

QUICK_SCALING = (1, 4)
"""GPT-2 layer counts of the solver-scaling measurement under ``--quick``."""


def _list_of(convert: Callable[[str], T], name: str) -> Callable[[str], tuple[T, ...]]:
    def parse(text: str) -> tuple[T, ...]:
        try:
            return tuple(convert(part.strip()) for part in text.split(",") if part.strip())
        except ValueError as e:
            raise argparse.ArgumentTypeError(
                f"{name} must be a comma-separated list (got {text!r}): {e}"
            )

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=(
        "Measure fxckpt's budget against torch.utils.checkpoint and torch.compile's memory budget "
        "(one subprocess per configuration) and write benchmarks.md / benchmarks.json."))
    p.add_argument(
        "--quick", action="store_true", help="tiny sizes and a single budget (0.5), for tests"
    )
    p.add_argument(
        "--models", type=_list_of(str, "--models"), help="comma-separated (default: all)"
    )
    p.add_argument(
        "--methods", type=_list_of(str, "--methods"), help="comma-separated (default: all)"
    )
    p.add_argument(
        "--budgets", type=_list_of(float, "--budgets"), help="fractions (default 0.25,0.5,0.75)"
    )
    p.add_argument("--repeats", type=positive_int, default=3, help="steps per median (default: 3)")
    p.add_argument("--jobs", type=positive_int, default=2,
                   help="memory subprocesses at once (default: 2)")
    p.add_argument(
        "--scaling-layers",
        type=_list_of(int, "--scaling-layers"),
        help="GPT-2 layer counts for the solver-scaling run (default 12,48,192,436: 615 to "
             "20,119 ops; '' skips)",
    )
    p.add_argument("--no-match-peers", dest="match_peers", action="store_false",
                   help="skip the fxckpt runs whose budget is each peer's measured peak")
    p.add_argument(
        "--out", type=Path, default=Path("docs"), help="output directory (default: docs/)"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log fxckpt's decisions")
    return p


def options_from(args: argparse.Namespace) -> "BenchOptions":
    from benchmarks.runner import BenchOptions

    given = {
        k: v
        for k, v in (
            ("models", args.models),
            ("methods", args.methods),
            ("budgets", args.budgets),
            ("scaling_layers", args.scaling_layers),
        )
        if v is not None
    }
    if args.quick:
        given.setdefault("budgets", (0.5,))
        given.setdefault("scaling_layers", QUICK_SCALING)
    try:
        return BenchOptions(
            quick=args.quick,
            repeats=args.repeats,
            jobs=args.jobs,
            match_peers=args.match_peers,
            **given,
        )
    except ValueError as e:
        build_parser().error(str(e))
        raise  # unreachable: error() exits


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark, write the report, print the targets; returns the exit code (0)."""
    from benchmarks.report import machine_info, write_report
    from benchmarks.runner import run_bench
    from benchmarks.targets import check_targets

    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    opts = options_from(args)
    machine = machine_info()
    result = dict(run_bench(opts), machine=machine)
    checks = check_targets(result["rows"], result["scaling"])
    md, js = write_report(result, checks, args.out)
    for c in checks:
        print(f"{c.verdict} {c.target}: {c.subject}: {c.detail}")
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
