"""``python -m benchmarks``: fxckpt's memory budget measured against PyTorch's own tools.

For each model (a 24-layer GELU MLP, a ResNet-style CNN with BatchNorm; GPT-2, BERT and a
Llama-style decoder from Hugging Face configs with random weights) and each budget fraction
(0.25 / 0.5 / 0.75; the Llama-style model also 0.66 for fxckpt), every method runs in its own
subprocesses and reports measured peak activation memory, the live-tensor tracker's count and the
median step time, next to fxckpt's predicted peak and solve time:

    parent ──run_in_subprocess──▶ memory child (MALLOC_MMAP_THRESHOLD_, 1 thread):
                                      build, transform/wrap/compile, warm-up step,
                                      RSS protocol (median of --repeats steps), tracker step
           ──run_in_subprocess──▶ time child (default allocator, 1 thread):
                                      method and a copy of the unmodified model timed by turns
           ──run_in_subprocess──▶ scaling child: fxckpt.solver.solve alone on 12/48/192-layer GPT-2
           ──▶ docs/benchmarks.md (tables, machine, targets PASS/FAIL) + docs/benchmarks.json
               + docs/pareto_<model>.png (memory against time, every method's points)

Why this protocol: a CPU has no ``max_memory_allocated``. With ``MALLOC_MMAP_THRESHOLD_=65536``
every tensor-sized allocation is an ``mmap`` returned to the OS when freed, so the resident-memory
high-water mark of one step (reset through ``/proc/self/clear_refs``) follows the tensors; the
variable is read at process start, hence a fresh process per configuration. That allocator makes
steps slower, so times come from a second process with the default allocator, in which the
unmodified model is timed by turns with the method: on a shared 2-core machine only ratios
against a baseline measured at the same time mean anything. One intra-op thread keeps those ratios
steady when other jobs compete for the cores.

A method that fails (a compile error, an infeasible budget, a crashed subprocess) becomes a row
with its error; the run goes on. The targets of the issue are checked by
:mod:`benchmarks.targets` and reported whether they pass or not.
"""

from benchmarks.methods import BUDGETED, METHODS, prepare
from benchmarks.models import MODELS, ModelSpec
from benchmarks.report import machine_info, render_markdown, write_report
from benchmarks.runner import BenchOptions, Config, configurations, run_bench
from benchmarks.targets import Check, check_targets

__all__ = [
    "BenchOptions", "Config", "configurations", "run_bench",
    "METHODS", "BUDGETED", "prepare", "MODELS", "ModelSpec",
    "Check", "check_targets", "machine_info", "render_markdown", "write_report", "main",
]


def main(argv: "list[str] | None" = None) -> int:
    """Command-line entry point (see :mod:`benchmarks.__main__`)."""
    from benchmarks.__main__ import main as _main

    return _main(argv)
