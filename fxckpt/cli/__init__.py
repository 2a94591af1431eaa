"""The ``fxckpt`` command line: ``fxckpt plan TARGET ...`` and ``fxckpt demo [--quick]``.

    fxckpt plan mypkg.models:make_model --input-shape 8,3,224,224 --budget 2GiB --report out/
    fxckpt demo --quick      # measure memory and step time of each strategy on a small GPT

One subcommand per task, each a small function taking the parsed arguments
(``python -m fxckpt`` calls :func:`main`).

``TARGET`` is ``module:callable`` (called with no arguments, it returns an ``nn.Module``) or a
Hugging Face ``config.json``; see :mod:`fxckpt.cli.model_source`. Random inputs of the given shapes
and dtypes stand for a batch (integer inputs are zeros: valid token ids for any vocabulary).
``--meta`` builds the model and its inputs on the meta device: a plan for a model larger than
the machine's memory.

A command line is used by people, so a mistake is one line on stderr that says what was wrong
and exits with code 2 (``-v`` shows the traceback), never a traceback by default.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from typing import Any, NoReturn, Optional, Sequence

import torch

from fxckpt.errors import CliError  # re-exported: the command line's error

__all__ = ["main", "build_parser", "CliError", "OneLineParser", "add_plan_command",
           "add_demo_command", "positive_int", "parse_shape", "make_inputs"]

log = logging.getLogger(__name__)

EPILOG = """examples:
  fxckpt plan torchvision.models:resnet18 --input-shape 8,3,224,224 --budget 0.5 --report out/
  fxckpt plan mypkg.models:make_gpt --input-shape 4,512 --dtype int64 --depth 2 --save gpt_ckpt/
  fxckpt plan mypkg.models:make_mlp --input-shape 32,1024 --every 2 --chunks 4 --devices cpu,cpu
  fxckpt plan llama-7b/config.json --meta --input-shape 1,4096 --dtype int64 --budget 16GiB \
      --plan-out plan.json

budgets: a fraction of the unmodified model's peak activation memory (0.4, 1.0), a number of
bytes (2000000000) or a size with a unit (800MB, 1.5GiB); 1 is refused as ambiguous. With
--chunks the plan is made for one micro-batch, and its budget and peaks are per micro-batch
(see docs/pipelines.md)."""


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
    """Add the ``demo`` subcommand (:mod:`fxckpt.cli.demo`) to the ``fxckpt`` parser."""
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
    from fxckpt.cli.demo import run_demo

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
        help="module:callable returning an nn.Module (e.g. mypkg.models:make_model), or a "
             "Hugging Face config.json (or a directory holding one): built with random weights",
    )
    p.add_argument(
        "--meta", action="store_true",
        help="build the model and inputs on the meta device: plans without memory for "
             "parameters or activations (a 70B config on a laptop); replay the plan with plan=",
    )
    p.add_argument(
        "--device-profile", choices=("h100", "h200", "a100", "cpu"),
        help="price the plan for this device (planning on the CPU or --meta for a GPU); default: "
             "the model's own device",
    )
    p.add_argument(
        "--model-dtype", metavar="DTYPE",
        help="dtype of the model's floating parameters (default: a config's dtype, else as built)",
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
        "--plan-out", metavar="FILE",
        help="write the plan as JSON, to replay with transform(model, plan=json.load(f))",
    )
    out.add_argument(
        "--seed", type=int, default=0, help="seed for the model and the inputs (default: 0)"
    )
    p.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    """The ``plan`` subcommand; returns the exit code."""
    from fxckpt.errors import FxckptError, SourceError

    try:
        return _plan(args)
    except (CliError, SourceError, FxckptError, Exception) as e:  # the model's own errors too
        if getattr(args, "verbose", False):
            raise
        text = str(e).strip().splitlines() or [type(e).__name__]
        more = " (run 'fxckpt -v plan ...' for the details)" if len(text) > 1 else ""
        print(f"fxckpt plan: error: {text[0]}{more}", file=sys.stderr)
        return 2


def _plan(args: argparse.Namespace) -> int:
    import fxckpt
    from fxckpt.viz.report import Progress

    from fxckpt.cli.model_source import build_model

    options = _strategy(args)
    shapes = [parse_shape(s) for s in args.input_shape]
    dtypes = _dtypes(args.dtype, len(shapes))
    model_dtype = _dtypes([args.model_dtype], 1)[0] if args.model_dtype else None
    if args.meta and (args.save or args.report):
        raise CliError("--meta plans only: a meta model has no weights to --save or run for a "
                       "--report; write the plan with --plan-out and replay it on the real model")
    with Progress(
        total=3 + (args.report is not None) + (args.save is not None), desc="fxckpt plan"
    ) as progress:
        torch.manual_seed(args.seed)
        model = build_model(args.target, meta=args.meta, dtype=model_dtype).train(not args.eval)
        progress.step("model built")
        inputs = make_inputs(shapes, dtypes, device="meta" if args.meta else None)
        try:
            tm = fxckpt.transform(model, **options, example_inputs=inputs)
        except Exception as e:
            hint = dtype_hint(model, inputs, args.input_shape)
            if hint is None:
                raise
            raise CliError(hint) from e
        progress.step("planned")
        plan = fxckpt.inspect(tm).plan
        print(plan)
        if args.plan_out:
            with open(args.plan_out, "w") as f:
                json.dump(plan.to_dict(), f, indent=1)
            print(f"plan written to {args.plan_out}")
        if args.save:
            path = fxckpt.save(tm, args.save)
            progress.step("saved")
            print(f"saved to {path}")
        if args.report:
            from fxckpt.viz.report import write_report

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
    options["device_profile"] = args.device_profile
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
    shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype],
    device: Optional[str] = None,
) -> tuple[torch.Tensor, ...]:
    """Random floats (standard normal) or zeros (integers, bools) of these shapes."""
    return tuple(
        torch.randn(s, dtype=d, device=device) if d.is_floating_point or d.is_complex
        else torch.zeros(s, dtype=d, device=device)
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
