"""The ``fxckpt`` command line: ``fxckpt plan TARGET ...`` and ``fxckpt demo [--quick]``.

    fxckpt plan mypkg.models:make_model --input-shape 8,3,224,224 --budget 2GiB --report out/
    fxckpt demo --quick      # measure memory and step time of each strategy on a small GPT

One subcommand per task, each a small function taking the parsed arguments
(``python -m fxckpt`` calls :func:`main`).

``TARGET`` is ``module:callable``; the callable (a function or a class) is called with no
arguments and must return an ``nn.Module``. The current directory is importable, as with
``python -m``. Random inputs of the given shapes and dtypes stand for a batch (integer inputs
are zeros: valid token ids for any vocabulary).

A command line is used by people, so a mistake is one line on stderr that says what was wrong
and exits with code 2 (``-v`` shows the traceback), never a traceback by default.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
from typing import Any, NoReturn, Optional, Sequence

import torch

__all__ = ["main", "build_parser", "CliError", "OneLineParser", "add_plan_command",
           "add_demo_command", "positive_int", "load_target", "parse_shape", "make_inputs"]

log = logging.getLogger(__name__)

EPILOG = """examples:
  fxckpt plan torchvision.models:resnet18 --input-shape 8,3,224,224 --budget 0.5 --report out/
  fxckpt plan mypkg.models:make_gpt --input-shape 4,512 --dtype int64 --depth 2 --save gpt_ckpt/
  fxckpt plan mypkg.models:make_mlp --input-shape 32,1024 --every 2 --chunks 4 --devices cpu,cpu

budgets: a fraction of the unmodified model's peak activation memory (0.4, 1.0), a number of
bytes (2000000000) or a size with a unit (800MB, 1.5GiB); 1 is refused as ambiguous. With
--chunks the plan is made for one micro-batch, and its budget and peaks are per micro-batch
(see docs/pipelines.md)."""


class CliError(Exception):
    """A mistake on the command line; printed as one line, exit code 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line (with a pointer to ``--help``), not two."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``fxckpt`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(name)s: %(message)s")
    return int(args.run(args))


def build_parser() -> argparse.ArgumentParser:
    """The ``fxckpt`` parser with its subcommands."""
    parser = OneLineParser(
        prog="fxckpt", description="Activation checkpointing chosen by torch.fx passes.",
        epilog="Run 'fxckpt COMMAND --help' for the options of a command.",
    )
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log fxckpt's decisions (and show tracebacks)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_demo_command(commands)
    add_plan_command(commands)
    return parser


def positive_int(text: str) -> int:
    """An argparse ``type=``: ``"3"`` -> 3; anything not an integer >= 1 is a usage error."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text!r})")
    return value


def add_demo_command(commands: Any) -> None:
    """Add the ``demo`` subcommand (:mod:`fxckpt.demo`) to the ``fxckpt`` parser."""
    demo = commands.add_parser(
        "demo", help="measure memory and time of each strategy on a small GPT",
        description="Transform a small GPT with each strategy and measure peak activation memory "
                    "(RSS, one subprocess per strategy) and step time against the unmodified "
                    "model.",
    )
    demo.add_argument("--quick", action="store_true",
                      help="a smaller model (a few seconds per strategy)")
    demo.add_argument("--repeats", type=positive_int, default=3,
                      help="steps per median (default: 3)")
    demo.add_argument("--threads", type=positive_int, default=1,
                      help="torch threads for timing steps (default: 1, steady on a shared "
                           "machine; memory is always measured with 1)")
    demo.add_argument("--jobs", type=positive_int, default=1,
                      help="memory-measuring processes run at once (default: 1)")
    demo.set_defaults(run=run_demo_command)


def run_demo_command(args: argparse.Namespace) -> int:
    """The ``demo`` subcommand; returns the exit code."""
    from fxckpt.demo import run_demo

    run_demo(quick=args.quick, repeats=args.repeats, threads=args.threads, jobs=args.jobs)
    return 0


def add_plan_command(commands: Any) -> None:
    """Add the ``plan`` subcommand to the ``fxckpt`` parser's subcommands."""
    p = commands.add_parser(
        "plan",
        help="plan a model and print (or report) what is saved and recomputed",
        description="Build a model from TARGET, plan activation checkpointing for random inputs "
        "of the\n"
        "given shapes and print the plan table; optionally write a report or an export.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "target",
        metavar="TARGET",
        help="module:callable returning an nn.Module (e.g. mypkg.models:make_model)",
    )
    p.add_argument(
        "--input-shape",
        action="append",
        metavar="SHAPE",
        required=True,
        help="shape of one positional input, e.g. 8,3,224,224 (repeat for several inputs)",
    )
    p.add_argument(
        "--dtype",
        action="append",
        metavar="DTYPE",
        help="dtype of the inputs: one for all, or one per --input-shape (default: float32)",
    )
    strategy = p.add_argument_group("strategy (give at most one of --every, --depth, --budget)")
    exclusive = strategy.add_mutually_exclusive_group()
    exclusive.add_argument(
        "--every", type=int, metavar="N", help="a segment every N units of work (matmuls, convs)"
    )
    exclusive.add_argument(
        "--depth", type=int, metavar="D", help="each module at nesting depth D is a segment"
    )
    exclusive.add_argument(
        "--budget", metavar="B",
        help="bound on peak activation memory: 0.4, 2000000000 or 1.5GiB (with --chunks: of "
             "one micro-batch's step)"
    )
    strategy.add_argument("--force", action="append", metavar="PATH=MODE", default=[],
                          help="pin a module: layers.0=save or layers.3=recompute (repeatable)")
    pipe = p.add_argument_group("pipeline")
    pipe.add_argument("--chunks", type=int, metavar="M", help="micro-batches per step")
    pipe.add_argument(
        "--devices", metavar="LIST", help="one device per stage, e.g. cpu,cpu or cuda:0,cuda:1"
    )
    out = p.add_argument_group("output")
    out.add_argument(
        "--eval", action="store_true", help="plan the model in eval() mode (default: train)"
    )
    out.add_argument(
        "--report",
        metavar="DIR",
        help="write plan.txt, plan.json, code.py, pictures and index.html",
    )
    out.add_argument(
        "--no-pareto", action="store_true", help="leave the Pareto picture out of the report"
    )
    out.add_argument(
        "--save", metavar="DIR", help="also export the transformed module (fxckpt.save)"
    )
    out.add_argument(
        "--seed", type=int, default=0, help="seed for the model and the inputs (default: 0)"
    )
    p.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    """The ``plan`` subcommand; returns the exit code."""
    from fxckpt.errors import FxckptError

    try:
        return _plan(args)
    except (CliError, FxckptError, ValueError, TypeError) as e:
        if getattr(args, "verbose", False):
            raise
        text = str(e).strip().splitlines() or [type(e).__name__]
        more = " (run 'fxckpt -v plan ...' for the details)" if len(text) > 1 else ""
        print(f"fxckpt plan: error: {text[0]}{more}", file=sys.stderr)
        return 2


def _plan(args: argparse.Namespace) -> int:
    import fxckpt
    from fxckpt.report import Progress

    options = _strategy(args)
    shapes = [parse_shape(s) for s in args.input_shape]
    dtypes = _dtypes(args.dtype, len(shapes))
    with Progress(
        total=3 + (args.report is not None) + (args.save is not None), desc="fxckpt plan"
    ) as progress:
        torch.manual_seed(args.seed)
        model = load_target(args.target).train(not args.eval)
        progress.step("model built")
        inputs = make_inputs(shapes, dtypes)
        try:
            tm = fxckpt.transform(model, **options, example_inputs=inputs)
        except Exception as e:
            hint = dtype_hint(model, inputs, args.input_shape)
            if hint is None:
                raise
            raise CliError(hint) from e
        progress.step("planned")
        print(fxckpt.inspect(tm).plan)
        if args.save:
            path = fxckpt.save(tm, args.save)
            progress.step("saved")
            print(f"saved to {path}")
        if args.report:
            from fxckpt.report import write_report

            index = write_report(tm, model, inputs, args.report, pareto=not args.no_pareto)
            progress.step("report written")
            print(f"report written to {index}")
        progress.step("done")
    return 0


def _strategy(args: argparse.Namespace) -> dict[str, Any]:
    from fxckpt.budget import parse_budget

    options: dict[str, Any] = {"every": args.every, "depth": args.depth}
    if args.budget is not None:
        parse_budget(args.budget)  # a bad budget fails here, before the model is built
        options["budget"] = args.budget  # read as transform(budget="0.5") reads it
    force = {}
    for item in args.force:
        path, sep, mode = item.partition("=")
        if not sep or not path or mode not in ("save", "recompute"):
            raise CliError(f"--force must look like PATH=save or PATH=recompute (got {item!r})")
        force[path] = mode
    options["force"] = force or None
    if args.chunks is not None:
        options["chunks"] = args.chunks
    if args.devices:
        options["devices"] = [d.strip() for d in args.devices.split(",") if d.strip()]
    return {k: v for k, v in options.items() if v is not None}


def parse_shape(text: str) -> tuple[int, ...]:
    """``"8,3,224,224"`` (or ``8x3x224x224``) -> ``(8, 3, 224, 224)``."""
    parts = [p.strip() for p in re.split(r"[,x]", text.strip())]
    if not parts or not all(re.fullmatch(r"\d+", p) and int(p) > 0 for p in parts):
        raise CliError(
            f"--input-shape must be positive integers separated by commas, e.g. 8,3,224,224 "
            f"(got {text!r})"
        )
    return tuple(int(p) for p in parts)


def _dtypes(names: Optional[Sequence[str]], count: int) -> list[torch.dtype]:
    names = list(names or ["float32"])
    if len(names) not in (1, count):
        raise CliError(
            f"give one --dtype for all inputs or one per --input-shape ({count}); got {len(names)}"
        )
    dtypes = []
    for name in names:
        dtype = getattr(torch, name.strip().removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise CliError(
                f"--dtype {name!r} is not a torch dtype; use e.g. float32, bfloat16, int64, bool"
            )
        dtypes.append(dtype)
    return dtypes * count if len(dtypes) == 1 else dtypes


def make_inputs(
    shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype]
) -> tuple[torch.Tensor, ...]:
    """Random floats (standard normal) or zeros (integers, bools) of these shapes."""
    return tuple(
        torch.randn(s, dtype=d) if d.is_floating_point or d.is_complex else torch.zeros(s, dtype=d)
        for s, d in zip(shapes, dtypes)
    )


class _IdsFound(Exception):
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class _IdsWatch(torch.overrides.TorchFunctionMode):
    """Stops the model at the first embedding lookup whose ids are not integers."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.nn.functional.embedding, torch.embedding, torch.nn.functional.one_hot):
            ids = args[0] if args else kwargs.get("input")
            if isinstance(ids, torch.Tensor) and ids.is_floating_point():
                raise _IdsFound(ids)
        return func(*args, **kwargs)


def dtype_hint(model: torch.nn.Module, inputs: Sequence[torch.Tensor],
               shapes: Sequence[str]) -> Optional[str]:
    """When the model failed on float inputs that it uses as token ids, the ``--dtype`` to give.

    Runs the model once in eval mode without grad (only after planning failed), stopping at the
    first embedding lookup of float ids; the input is the one whose storage those ids share.
    """
    if not any(t.is_floating_point() for t in inputs):
        return None
    training = model.training
    try:
        with torch.no_grad(), _IdsWatch():
            model.eval()(*inputs)
        return None
    except _IdsFound as found:
        ids = found.tensor.untyped_storage().data_ptr()
        used = [i for i, t in enumerate(inputs) if t.untyped_storage().data_ptr() == ids]
    except Exception:
        return None
    finally:
        model.train(training)
    if not used:
        return None
    names = ["int64" if i in used else str(t.dtype).removeprefix("torch.")
             for i, t in enumerate(inputs)]
    flags = " ".join(f"--dtype {n}" for n in (names[:1] if len(set(names)) == 1 else names))
    which = ", ".join(f"input {i + 1} (--input-shape {shapes[i]})" for i in used)
    return (f"{which} is {str(inputs[used[0]].dtype).removeprefix('torch.')} but the model uses "
            f"it as token ids (an embedding lookup needs integers); pass {flags}")


def load_target(text: str) -> torch.nn.Module:
    """Import ``module:callable`` and call it (an ``nn.Module`` instance is used as it is)."""
    module_name, sep, attr = text.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"TARGET must look like package.module:callable (got {text!r})")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    module = _import(module_name)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CliError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not isinstance(obj, torch.nn.Module):
        if not callable(obj):
            raise CliError(f"{text} is a {type(obj).__name__}, not a callable returning a model")
        try:
            obj = obj()
        except Exception as e:
            raise CliError(f"calling {text}() failed: {type(e).__name__}: {e}") from e
    if not isinstance(obj, torch.nn.Module):
        raise CliError(f"{text}() returned a {type(obj).__name__}, not a torch.nn.Module")
    return obj


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise CliError(
                f"no module named {name!r} (run from the directory that contains it, or set "
                "PYTHONPATH)"
            ) from e
        raise CliError(f"importing {name!r} failed: {e}") from e
    except Exception as e:
        raise CliError(f"importing {name!r} failed: {type(e).__name__}: {e}") from e
