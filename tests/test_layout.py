"""The tests mirror the package: a newcomer finds a module's tests from its path.

``fxckpt/<package>/<module>.py`` is tested in ``tests/<package>/test_<module>.py``; a package's
``__init__.py`` with functions or classes of its own in ``tests/<package>/test_<package>.py``.
A module with no function or class (data, re-exports) has no logic to test. The modules still
without a test file of their own are listed in ``UNMIRRORED``, each with where it is tested: the
list only shrinks (a listed module that gains a test file, or is gone, fails here too). A folder
whose test file shares a basename with another test file (``tests/viz/test_layout.py`` and this
one) is a package, with an ``__init__.py``: pytest's default import mode needs that.

Test folders that name no package of fxckpt are suites, listed in ``SUITES`` with what they are.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fxckpt"
TESTS = ROOT / "tests"

SUITES = {
    "frameworks": "the framework tier (-m frameworks): fxckpt in Trainer, PEFT, Lightning, ...",
    "bench": "the benchmarks/ package (python -m benchmarks), not fxckpt",
    "cuda": "the CUDA tier: tests that need a GPU, across modules",
    "dynamo": "the Dynamo path end to end (fxckpt/serve/dynamo/ through torch.compile)",
}
"""Folders under tests/ that mirror no package: what each holds."""

UNMIRRORED = {
}
"""Modules with logic and no ``tests/<package>/test_<module>.py``: where they are tested."""


def _has_logic(path: Path) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return any(isinstance(node, kinds) for node in tree.body)


def _test_file(module: Path) -> Path:
    """Where the tests of ``module`` (a path relative to the package) live."""
    parts = module.parent.parts
    if module.name == "__init__.py":
        return TESTS.joinpath(*parts, f"test_{parts[-1] if parts else 'fxckpt'}.py")
    return TESTS.joinpath(*parts, f"test_{module.stem}.py")


def _modules() -> dict[str, Path]:
    """Every module with logic, by its path relative to the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "__main__.py" and _has_logic(path):
            found[path.relative_to(PACKAGE).as_posix()] = path.relative_to(PACKAGE)
    return found


def test_every_module_with_logic_has_a_test_file_or_says_where_it_is_tested() -> None:
    modules = _modules()
    missing = [f"fxckpt/{name}: no {_test_file(module).relative_to(ROOT)}"
               for name, module in modules.items()
               if not _test_file(module).is_file() and name not in UNMIRRORED]
    assert not missing, "add the test file, or list the module in UNMIRRORED:\n" + "\n".join(
        missing)


def test_the_list_of_modules_without_a_test_file_only_shrinks() -> None:
    modules = _modules()
    gone = [f"fxckpt/{name}: no such module with logic" for name in UNMIRRORED
            if name not in modules]
    mirrored = [f"fxckpt/{name}: has {_test_file(modules[name]).relative_to(ROOT)}"
                for name in UNMIRRORED if name in modules and _test_file(modules[name]).is_file()]
    assert not gone + mirrored, "take these out of UNMIRRORED:\n" + "\n".join(gone + mirrored)


def test_test_folders_mirror_a_package_or_are_named_suites() -> None:
    stray = []
    for path in sorted(TESTS.rglob("test_*.py")):
        folder = path.parent.relative_to(TESTS)
        if folder.parts and folder.parts[0] in SUITES:
            continue
        if not PACKAGE.joinpath(*folder.parts).is_dir():
            stray.append(f"{path.relative_to(ROOT)}: no package fxckpt/{folder.as_posix()}")
    assert not stray, "move the file, or name its folder in SUITES:\n" + "\n".join(stray)


def test_the_suites_and_the_package_name_different_folders() -> None:
    assert not [name for name in SUITES if (PACKAGE / name).is_dir()]
