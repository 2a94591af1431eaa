"""House rules a reader relies on: lines of at most 99 columns, files of about 400 lines.

Each rule is one test that names every file breaking it, so a failure lists all of them at once.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for d in ("fxckpt", "benchmarks", "tests", "scripts")
                 for p in (ROOT / d).rglob("*.py"))
MAX_COLUMNS = 99
MAX_LINES = 420  # "about 400": split a module that grows past it


PACKAGE = [p for p in SOURCES if p.relative_to(ROOT).parts[0] == "fxckpt"]


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_there_are_sources_to_check() -> None:
    assert len(PACKAGE) > 50 and len(SOURCES) > len(PACKAGE)


def test_lines_fit_in_99_columns() -> None:
    long = [f"{path.relative_to(ROOT)}:{i}: {len(line)} columns"
            for path in SOURCES for i, line in enumerate(_lines(path), 1)
            if len(line) > MAX_COLUMNS]
    assert not long, f"{len(long)} lines over {MAX_COLUMNS} columns:\n" + "\n".join(long)


def test_package_modules_stay_readable_in_one_sitting() -> None:
    counts = {path: len(_lines(path)) for path in PACKAGE}
    big = [f"{path.relative_to(ROOT)} has {count} lines: split it by concept"
           for path, count in counts.items() if count > MAX_LINES]
    assert not big, f"{len(big)} modules over {MAX_LINES} lines:\n" + "\n".join(big)


MAX_BODY_LINES = 80
# argparse setup: one add_argument call per option, each with its help text
LONG_BY_NATURE = {"fxckpt/cli/__init__.py:add_plan_command"}


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the function's end."""
    body = fn.body
    if (len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        body = body[1:]
    return (fn.end_lineno or fn.lineno) - body[0].lineno + 1


def test_functions_fit_on_a_screen_or_two() -> None:
    found, long = set(), []
    for path in PACKAGE:
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                where = f"{rel}:{node.name}"
                found.add(where)
                if _body_lines(node) > MAX_BODY_LINES and where not in LONG_BY_NATURE:
                    long.append(f"{where}: {_body_lines(node)} lines")
    assert LONG_BY_NATURE <= found, f"allowed but gone: {sorted(LONG_BY_NATURE - found)}"
    assert not long, (f"{len(long)} functions over {MAX_BODY_LINES} lines after the docstring "
                      "(split them by step):\n" + "\n".join(long))
