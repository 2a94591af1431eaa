"""Edits a forger makes to an export's JSON files (the forge fixture applies them).

Each :data:`Change` edits a decoded JSON file in place; its second argument is the path of the
marker file the evil module writes when anything of it runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

EVIL_SOURCE = """
import pathlib
pathlib.Path({marker!r}).write_text("imported")


def run(*args, **kwargs):
    pathlib.Path({marker!r}).write_text("called")


class Evil:
    def __init__(self, *args, **kwargs):
        run()
"""
EVIL = f"fxckpt_evil_{os.getpid()}"
"""A module the crafted exports name; importing or calling it writes the marker file."""


ROOT, SEGMENT, STRUCTURE = "programs/v0/root.json", "programs/v0/segment_0.json", "structure.json"
Change = Callable[[Any, str], None]
"""Edits a decoded JSON file in place; the second argument is the marker file's path."""


def call(target: str, *args: Any) -> Change:
    """The first call_function node now calls ``target`` (``MARKER`` in args: the marker path)."""
    def change(program: dict, marker: str) -> None:
        node = first(program, "call_function")
        node["target"], node["kwargs"] = target, {}
        node["args"] = [marker if a == "MARKER" else a for a in args]
    return change


def set_node(kind: str, **fields: Any) -> Change:
    """Set ``fields`` of the first ``kind`` node (``MARKER`` inside a string: the marker path)."""
    def change(program: dict, marker: str) -> None:
        first(program, kind).update(json.loads(json.dumps(fields).replace("MARKER", marker)))
    return change


def first(program: dict, op: str) -> dict:
    return next(n for n in program["nodes"] if n["op"] == op)


def leaf(**fields: Any) -> Change:
    def change(structure: dict, marker: str) -> None:
        modules = structure["variants"][0]["modules"]
        next(e for e in modules if e.get("kind") == "leaf").update(fields)
    return change


def spec_of(node_type: str, context: Any) -> Change:
    schema = {"type": node_type, "context": json.dumps(context), "children_spec": []}
    spec = json.dumps([1, schema])

    def change(structure: dict, marker: str) -> None:
        structure["variants"][0]["modules"][0]["specs"] = {"_spec_0": spec}
    return change


def pytree_args(*orig_args: str) -> Change:
    def change(program: dict, marker: str) -> None:
        args = [a.replace("MARKER", marker) for a in orig_args]
        program["pytree"] = {"orig_args": args, "in_spec": None, "out_spec": None}
    return change


def rehash(root: Path, rel: str, data: bytes) -> None:
    """Write ``rel`` and list it in the manifest with its hash (what a forger can do)."""
    from fxckpt.export.files import content_hash, sha256_bytes

    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"][rel] = sha256_bytes(data)
    manifest["content_hash"] = content_hash(manifest["files"])
    (root / "manifest.json").write_text(json.dumps(manifest))


X = {"__node__": "x"}
OPEN = "open('MARKER', 'w')"
