"""export/files.py: the export directory on disk, written atomically with a manifest of hashes
(and an HMAC under a key), and verified file by file before anything is parsed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fxckpt.export import ExportError
from fxckpt.export.files import (FORMAT, FORMAT_VERSION, MANIFEST, as_key, content_hash,
                                 manifest_mac, sha256_bytes, verify, write_atomically,
                                 write_export)

TEXTS = {"structure.json": '{"modules": []}', "programs/v0/segment_0.json": "[]"}


def _save(target: Path, key: bytes | None = None) -> Path:
    return write_atomically(target, lambda tmp: write_export(
        tmp, TEXTS, {"w": torch.ones(2)}, {"torch": "2.13"}, key=key))


def test_an_export_is_written_with_a_manifest_that_lists_every_file(tmp_path: Path) -> None:
    root = _save(tmp_path / "out")
    manifest = json.loads((root / MANIFEST).read_text())
    assert (manifest["format"], manifest["format_version"]) == (FORMAT, FORMAT_VERSION)
    assert sorted(manifest["files"]) == ["programs/v0/segment_0.json", "structure.json",
                                         "weights.safetensors"]
    assert manifest["files"]["structure.json"] == sha256_bytes(TEXTS["structure.json"].encode())
    assert manifest["content_hash"] == content_hash(manifest["files"])
    assert "mac" not in manifest and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_verified_export_reads_its_texts_and_weights(tmp_path: Path) -> None:
    store = verify(_save(tmp_path / "out"))
    assert store.read_text("structure.json") == TEXTS["structure.json"]
    assert torch.equal(store.tensors()["w"], torch.ones(2))
    with pytest.raises(ExportError, match="refers to 'payload.py', which its manifest does not"):
        store.read_text("payload.py")


def test_content_hash_covers_paths_and_hashes_in_any_order() -> None:
    assert content_hash({"a": "1", "b": "2"}) == content_hash({"b": "2", "a": "1"})
    assert content_hash({"a": "1", "b": "2"}) != content_hash({"a": "2", "b": "1"})
    assert content_hash({}).startswith("sha256:")


def test_a_failed_write_leaves_nothing_and_a_later_save_replaces_the_export(
        tmp_path: Path) -> None:
    def fail(tmp: Path) -> None:
        (tmp / "half").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(tmp_path / "out", fail)
    assert list(tmp_path.iterdir()) == []
    _save(tmp_path / "out")
    (tmp_path / "out" / "structure.json").write_text("old")
    verify(_save(tmp_path / "out"))  # replaced whole
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_file_or_a_directory_that_is_not_an_export_is_never_replaced(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="is a file; give a directory path"):
        _save(tmp_path / "file")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(ExportError, match=r"exists and is not an fxckpt export \(no manifest"):
        _save(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "x"


@pytest.mark.parametrize("change, message", [
    (lambda r: (r / "structure.json").write_text("{}"), "structure.json"),
    (lambda r: (r / "programs/v0/segment_0.json").unlink(), "is incomplete: programs/v0/"),
    (lambda r: (r / "payload.py").write_text(""), "holds payload.py, which its manifest does"),
    (lambda r: (r / MANIFEST).unlink(), "manifest.json is missing"),
    (lambda r: (r / MANIFEST).write_text("{"), "manifest.json is not valid JSON"),
])
def test_any_change_is_refused_by_verify(tmp_path: Path, change, message: str) -> None:
    root = _save(tmp_path / "out")
    change(root)
    with pytest.raises(ExportError, match=message):
        verify(root)


def _rewrite_manifest(root: Path, **fields) -> None:
    manifest = json.loads((root / MANIFEST).read_text())
    manifest.update(fields)
    (root / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("fields, message", [
    ({"format_version": 2}, "has format version 2, whose loader checked"),
    ({"format_version": 9}, "has format version 9; this fxckpt reads version 3"),
    ({"format": "other"}, "is not an fxckpt export"),
    ({"content_hash": "sha256:0"}, "its content hash does not match"),
])
def test_a_manifest_of_another_format_or_hash_is_refused(tmp_path: Path, fields: dict,
                                                         message: str) -> None:
    root = _save(tmp_path / "out")
    _rewrite_manifest(root, **fields)
    with pytest.raises(ExportError, match=message):
        verify(root)


def test_a_keyed_export_needs_its_key_and_no_other(tmp_path: Path) -> None:
    root = _save(tmp_path / "out", key=b"secret")
    manifest = json.loads((root / MANIFEST).read_text())
    assert manifest["mac"] == {"algorithm": "hmac-sha256",
                               "value": manifest_mac(manifest, b"secret")}
    assert verify(root, key=b"secret").manifest == manifest
    with pytest.raises(ExportError, match="was saved with a key"):
        verify(root)
    with pytest.raises(ExportError, match=r"MAC mismatch"):
        verify(root, key=b"other")
    with pytest.raises(ExportError, match="has no MAC, but key= was given"):
        verify(_save(tmp_path / "plain"), key=b"secret")


def test_the_mac_ignores_itself_and_covers_everything_else() -> None:
    manifest = {"files": {"a": "1"}, "content_hash": "x"}
    assert manifest_mac({**manifest, "mac": "anything"}, b"k") == manifest_mac(manifest, b"k")
    assert manifest_mac({**manifest, "files": {"a": "2"}}, b"k") != manifest_mac(manifest, b"k")


def test_keys_are_non_empty_text_or_bytes() -> None:
    assert as_key("k\u00e9") == "k\u00e9".encode() and as_key(bytearray(b"k")) == b"k"
    assert as_key(None) is None
    for bad in ("", b"", 3):
        with pytest.raises(ExportError, match="key must be a non-empty str or bytes"):
            as_key(bad)
