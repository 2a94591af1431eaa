"""The ``fxckpt`` command line: ``fxckpt demo [--quick]`` and ``fxckpt plan TARGET ...``.

One subcommand per task, each a small function taking the parsed arguments; ``plan`` lives in
:mod:`fxckpt.cli`. Usage mistakes are one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
from typing import Optional, Sequence

__all__ = ["main", "build_parser"]

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    from fxckpt.cli import OneLineParser, add_plan_command

    parser = OneLineParser(
        prog="fxckpt", description="Activation checkpointing chosen by torch.fx passes.",
        epilog="Run 'fxckpt COMMAND --help' for the options of a command.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log fxckpt's decisions (and show tracebacks)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo", help="measure memory and time of each strategy on a small GPT",
        description="Transform a small GPT with each strategy and measure peak activation memory "
                    "(RSS, one subprocess per strategy) and step time against the unmodified model.",
    )
    demo.add_argument("--quick", action="store_true", help="a smaller model (a few seconds per strategy)")
    demo.add_argument("--repeats", type=_positive_int, default=3, help="steps per median (default: 3)")
    demo.add_argument("--threads", type=_positive_int, default=1,
                      help="torch threads for timing steps (default: 1, steady on a shared machine; "
                           "memory is always measured with 1)")
    demo.add_argument("--jobs", type=_positive_int, default=1,
                      help="memory-measuring processes run at once (default: 1)")
    demo.set_defaults(run=_demo)
    add_plan_command(commands)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text!r})")
    return value


def _demo(args: argparse.Namespace) -> int:
    from fxckpt.demo import run_demo

    run_demo(quick=args.quick, repeats=args.repeats, threads=args.threads, jobs=args.jobs)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``fxckpt`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    return int(args.run(args))


if __name__ == "__main__":
    raise SystemExit(main())
