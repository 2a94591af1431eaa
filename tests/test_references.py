"""Docstrings name what exists: every ``fxckpt.x.y`` a docstring or comment in the package
points at (``:mod:`fxckpt.solver```, ``fxckpt.runtime.segment.SegmentModule``) is a module or an
attribute (a dataclass field counts), so a renamed or removed module leaves no stale pointer.
"""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path
from typing import Any

import fxckpt

PACKAGE = Path(fxckpt.__file__).parent
DOTTED = re.compile(r"\bfxckpt(?:\.[A-Za-z_]\w*)+")
# names fxckpt gives things at run time (log channels, the namespace of the functions a
# captured graph calls), not Python objects
RUN_TIME_NAMES = re.compile(r"\"fxckpt\.[\w.]+\"")


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            fields = getattr(obj, "__dataclass_fields__", {}) if isinstance(obj, type) else {}
            if name in fields:
                obj = fields[name]
                continue
            with warnings.catch_warnings():  # fxckpt.Segment: a deprecated alias, still there
                warnings.simplefilter("ignore", DeprecationWarning)
                if not hasattr(obj, name):
                    return False
                obj = getattr(obj, name)
        return True
    return False


def test_every_dotted_reference_in_the_package_resolves() -> None:
    stale = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = RUN_TIME_NAMES.sub("", path.read_text(encoding="utf-8"))
        for ref in sorted(set(DOTTED.findall(text))):
            if not _resolves(ref.rstrip(".")):
                stale.append(f"{path.relative_to(PACKAGE.parent)}: {ref}")
    assert not stale, "references to nothing:\n" + "\n".join(stale)
