"""The notebooks in notebooks/ run top to bottom and draw pictures, and are committed with the
outputs of one fresh run (``scripts/run_notebooks.py --write`` makes them), so that they read as
documents where they are published."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
RUN = "python scripts/run_notebooks.py --write"


def _runner() -> ModuleType:
    """``scripts/run_notebooks.py``, which executes a notebook as the tests do."""
    spec = importlib.util.spec_from_file_location("run_notebooks", REPO / "scripts" /
                                                  "run_notebooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _code_cells(nb: object) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]  # type: ignore[attr-defined]


def _images(nb: object) -> list:
    return [o for c in _code_cells(nb) for o in c.outputs if "image/png" in o.get("data", {})]


def _errors(nb: object) -> list:
    return [o for c in _code_cells(nb) for o in c.outputs if o.get("output_type") == "error"]


def test_there_are_notebooks() -> None:
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_pipeline.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebooks_hold_the_outputs_of_one_run(path: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    counts = [c.execution_count for c in _code_cells(nb)]
    assert counts == list(range(1, len(counts) + 1)), (
        f"{path.name}: code cells ran as {counts}, not once each from the top; run '{RUN}'"
    )
    assert _images(nb) and not _errors(nb), f"{path.name}: no picture, or an error; run '{RUN}'"
    text = "".join(o.get("text", "") for c in _code_cells(nb) for o in c.outputs)
    assert "Warning" not in text and str(REPO) not in text, (
        f"{path.name}: outputs hold a warning or this machine's paths"
    )


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_draws(path: Path) -> None:
    for module in ("nbformat", "nbclient", "ipykernel", "matplotlib"):
        pytest.importorskip(module)
    nb = _runner().execute(path)  # raises CellExecutionError, naming the cell, when one fails
    assert _images(nb), f"{path.name} produced no picture"
    assert not _errors(nb)
