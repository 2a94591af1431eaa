"""House rules a reader relies on: lines of at most 99 columns, files of about 400 lines."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for d in ("fxckpt", "tests", "scripts") for p in (ROOT / d).rglob("*.py"))
MAX_COLUMNS = 99
MAX_LINES = 420  # "about 400": split a module that grows past it


PACKAGE = [p for p in SOURCES if p.relative_to(ROOT).parts[0] == "fxckpt"]


def test_there_are_sources_to_check() -> None:
    assert len(PACKAGE) > 50 and len(SOURCES) > len(PACKAGE)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_lines_fit_in_99_columns(path: Path) -> None:
    lines = path.read_text(encoding="utf-8").splitlines()
    long = [f"{path.relative_to(ROOT)}:{i}: {len(line)} columns"
            for i, line in enumerate(lines, 1) if len(line) > MAX_COLUMNS]
    assert not long, "\n".join(long)


@pytest.mark.parametrize("path", PACKAGE, ids=lambda p: str(p.relative_to(ROOT)))
def test_package_modules_stay_readable_in_one_sitting(path: Path) -> None:
    count = len(path.read_text(encoding="utf-8").splitlines())
    assert count <= MAX_LINES, f"{path.relative_to(ROOT)} has {count} lines: split it by concept"
