"""Run the notebooks in notebooks/ top to bottom; with ``--write``, commit-ready outputs.

    .venv/bin/python scripts/run_notebooks.py            # run each notebook, report failures
    .venv/bin/python scripts/run_notebooks.py --write    # and write the outputs back

The notebooks are committed with the outputs of one fresh run so that they read as documents
on GitHub; ``tests/test_notebooks.py`` checks that they carry such outputs and, in its slow
tests, that they still run with the code of the checkout. Each notebook runs in a fresh kernel
whose working directory is a temporary one (whatever a notebook writes lands there, not in the
repository), with this checkout first on ``PYTHONPATH`` and without tqdm's warning that
``ipywidgets`` is missing (it names this machine's paths; a reader's Jupyter has ipywidgets).
Nothing is written when any notebook fails. Cell timing is not recorded, so re-running on
unchanged code changes little besides pictures' bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
QUIET = "ignore:IProgress not found"
"""A ``PYTHONWARNINGS`` entry: tqdm.auto's warning when ipywidgets is not installed."""


@contextlib.contextmanager
def kernel_environment() -> Iterator[None]:
    """The environment a kernel started inside inherits: this checkout importable, quiet tqdm."""
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "PYTHONWARNINGS")}
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), saved["PYTHONPATH"]]))
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [saved["PYTHONWARNINGS"], QUIET]))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def execute(path: Path, timeout: int = 600) -> Any:
    """The notebook at ``path`` executed in a fresh kernel (an ``nbformat`` NotebookNode).

    Raises ``nbclient``'s ``CellExecutionError``, naming the cell, when any cell fails.
    """
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    with kernel_environment(), tempfile.TemporaryDirectory(prefix="fxckpt-notebook-") as workdir:
        client = nbclient.NotebookClient(
            nb, timeout=timeout, kernel_name="python3", record_timing=False,
            resources={"metadata": {"path": workdir}},
        )
        client.execute()
    return nb


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path,
                        help="notebooks to run (default: every notebooks/*.ipynb)")
    parser.add_argument("--write", action="store_true",
                        help="write the executed notebooks back in place (only if all ran)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args(argv)
    import nbformat

    paths = args.paths or sorted(NOTEBOOKS.glob("*.ipynb"))
    executed = {}
    for path in paths:
        print(f"running {path.name} ...", flush=True)
        try:
            executed[path] = execute(path, args.timeout)
        except Exception as e:  # noqa: BLE001 - report every notebook, then fail
            print(f"{path.name} failed: {type(e).__name__}: {str(e)[-2000:]}", file=sys.stderr)
    if len(executed) < len(paths):
        print("nothing written: a notebook failed", file=sys.stderr)
        return 1
    for path, nb in executed.items():
        if args.write:
            nbformat.validate(nb)
            nbformat.write(nb, path)
            print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
