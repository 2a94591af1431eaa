"""The README's layout tree names every module of the package, and nothing that is not there.

The tree is written by hand (each line says what its module is for), so this test is what keeps
it generated from the tree in effect: a module added, moved or removed without its line fails
here, naming the line to write or to drop.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "fxckpt"


def tree_lines(readme: str) -> list[str]:
    """The lines of the fenced block under ``## Layout`` that describe ``fxckpt/``."""
    section = readme.split("\n## Layout", 1)[1]
    block = section.split("```", 2)[1]
    lines = block.splitlines()[1:]
    start = lines.index("fxckpt/")
    out = []
    for line in lines[start + 1:]:
        if line and not line.startswith(" "):
            break  # the next top-level folder (benchmarks/, scripts/, tests/)
        out.append(line)
    return out


def documented(lines: list[str]) -> set[str]:
    """Paths under ``fxckpt/`` the tree names: ``a.py``, ``a.py, b.py``, ``pkg/``, ``pkg/a.py``
    at the indentation of their folder (two spaces a level)."""
    found: set[str] = set()
    folders: list[str] = []
    for line in lines:
        stripped = line.lstrip(" ")
        depth = (len(line) - len(stripped)) // 2 - 1
        names = re.match(r"((?:[\w/]+(?:\.py|/))(?:,\s*[\w/]+(?:\.py|/))*)", stripped)
        if not names or depth < 0:
            continue  # a description's second line
        folders = folders[:depth]
        for name in re.split(r",\s*", names.group(1)):
            path = "/".join([*folders, name.rstrip("/")])
            found.add(path + ("/" if name.endswith("/") else ""))
            parts = path.split("/")
            found.update("/".join(parts[:i]) + "/" for i in range(1, len(parts)))
        if names.group(1).endswith("/") and "," not in names.group(1):
            folders.append(names.group(1).rstrip("/"))
    return found


def on_disk() -> set[str]:
    """Every module and package of ``fxckpt/`` (``__init__.py`` and ``__main__.py`` are their
    package's own)."""
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.name not in ("__init__.py", "__main__.py"):
            found.add(rel.as_posix())
        found.update("/".join(rel.parts[:i]) + "/" for i in range(1, len(rel.parts)))
    return found


def test_the_parser_reads_names_lists_and_folders() -> None:
    lines = ["  api.py             transform()", "  cli/               the command line",
             "    demo.py            the demo", "                       (a second line)",
             "    a.py, b.py  two modules", "  integrations/hf.py the rules", "  plan.py    x"]
    assert documented(lines) == {"api.py", "cli/", "cli/demo.py", "cli/a.py", "cli/b.py",
                                 "integrations/", "integrations/hf.py", "plan.py"}


def test_the_readme_tree_is_the_package_tree() -> None:
    lines = tree_lines((REPO / "README.md").read_text(encoding="utf-8"))
    written, there = documented(lines), on_disk()
    missing = sorted(there - written)
    gone = sorted(p for p in written - there if not (PACKAGE / p).exists())  # __init__.py
    assert not missing, f"modules the README's layout does not name: {missing}"
    assert not gone, f"the README's layout names what fxckpt/ does not have: {gone}"


def test_the_design_diagram_names_every_package_and_the_top_level() -> None:
    """docs/design.md's layout diagram: a row per package, and the top level's modules on the
    ``fxckpt/*.py`` row."""
    text = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    diagram = text.split("## Layout: folders follow the pipeline", 1)[1].split("\n## ", 1)[0]
    packages = sorted(p.name for p in PACKAGE.iterdir()
                      if p.is_dir() and (p / "__init__.py").exists())
    assert [p for p in packages if f"fxckpt/{p}/" not in diagram] == []
    vocabulary = diagram.split("fxckpt/*.py", 1)[1].split("\n    fxckpt/", 1)[0]
    vocabulary = vocabulary.split("\n    benchmarks/", 1)[0]
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert [m for m in top if not re.search(rf"\b{m}\b", vocabulary)] == []
