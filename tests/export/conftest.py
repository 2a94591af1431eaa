"""Fixtures for the forged-export tests: a saved template, and a forger that edits it.

Whoever can write an export's files can recompute every hash, so each crafted case edits one file
of a valid export and recomputes the manifest's hashes (what a forger can do without the key).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import types
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

import fxckpt
from crafting import EVIL, EVIL_SOURCE, rehash
from models import MLP


@pytest.fixture(scope="module")
def saved_mlp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "m"
    tm = fxckpt.transform(MLP(depth=2), every=1, example_inputs=(torch.randn(4, 32),))
    fxckpt.save(tm, path)
    return path


@pytest.fixture
def forge(saved_mlp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh copy of an export, an importable module that writes a marker file when imported
    or called, and ``edit(rel, change)``: change a file and recompute the manifest's hashes."""
    root = tmp_path / "m"
    shutil.copytree(saved_mlp, root)
    marker = tmp_path / "pwned"
    (tmp_path / f"{EVIL}.py").write_text(EVIL_SOURCE.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))

    def put(rel: str, data: bytes, replaces: str = "") -> None:
        """Write ``rel`` (instead of ``replaces``) and list it in the manifest with its hash."""
        root = ns.root  # a test may point the helpers at a copy
        if replaces:
            manifest = json.loads((root / "manifest.json").read_text())
            del manifest["files"][replaces]
            (root / replaces).unlink()
            (root / "manifest.json").write_text(json.dumps(manifest))
        rehash(root, rel, data)

    def edit(rel: str, change: Callable[[Any], Any]) -> None:
        path = ns.root / rel
        data = json.loads(path.read_text()) if path.exists() else None
        result = change(data)
        put(rel, (result if isinstance(result, str) else json.dumps(data)).encode())

    def edit_bytes(rel: str, change: Callable[[bytes], bytes]) -> None:
        put(rel, change((ns.root / rel).read_bytes()))

    @contextlib.contextmanager
    def copy(target: Path) -> Iterator[None]:
        """The export copied to ``target``, the helpers pointed at the copy while inside."""
        shutil.copytree(ns.root, target)
        original, ns.root = ns.root, target
        try:
            yield
        finally:
            ns.root = original

    ns = types.SimpleNamespace(root=root, marker=marker, edit=edit, edit_bytes=edit_bytes,
                               put=put, copy=copy)
    yield ns
    assert not marker.exists(), "the crafted export ran code"
    assert EVIL not in sys.modules, "the crafted export imported a module"


