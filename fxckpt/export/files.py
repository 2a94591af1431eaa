"""The export directory on disk: atomic writing, the manifest, hash checks, weights.

Two promises live here:

* **No half-written export ever loads.** Files are written into a hidden temporary directory
  next to the target, the manifest last, and the directory is renamed into place. A crash
  leaves at most a hidden ``.NAME.tmp-*`` directory without a manifest, which ``load`` refuses.
  Replacing an existing export renames the old one away first; a directory that is not an
  export is never replaced.
* **Nothing corrupted is read.** The manifest lists the SHA-256 of every file and a content
  hash over all of them; ``load`` checks them all before parsing anything, and reads files only
  through :class:`Verified`, from bytes whose hash it has just checked. Anyone who can edit the
  files can recompute those hashes, so they catch corruption, not forgery. For that, ``save``
  takes a ``key``: the manifest then carries an HMAC-SHA256 of itself (so of every file's hash)
  under that key, and ``load`` refuses a keyed export without the key, with another key, or
  with any change to any file. An export never holds code, keyed or not (see
  :mod:`fxckpt.export.program`).

    target/
      manifest.json     format, versions, files {path: sha256}, content_hash, [mac]
      structure.json    plan.json   weights.safetensors
      programs/v0/*.json            graphs/v0.json
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from fxckpt.errors import ExportError
from fxckpt.export.weights import read_weights, sha256_bytes, weights_bytes

__all__ = ["FORMAT", "FORMAT_VERSION", "write_atomically", "write_export", "Verified", "verify",
           "sha256_bytes", "as_key", "manifest_mac"]

FORMAT = "fxckpt-export"
FORMAT_VERSION = 3
"""3: checked against the closed allowlist, Tensor methods as ``torch.Tensor.<name>`` calls, no
file the manifest does not list; 2: graphs as node lists checked against a denylist; 1: generated
code, which this fxckpt does not run."""
MAX_JSON_BYTES = 64 << 20
"""Default cap on each JSON file of an export (``fxckpt.load(max_json_bytes=)``), checked before
it is read: parsing costs about 20x a file's size in memory (a 57 MiB file, 1.2 GiB). The largest
file of a 32-layer Llama's export is about 1 MiB."""
MAC_ALGORITHM = "hmac-sha256"
MANIFEST = "manifest.json"
PathLike = Union[str, os.PathLike]


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def content_hash(files: dict[str, str]) -> str:
    """One hash over every file's path and hash."""
    joined = "".join(f"{path}\0{digest}\n" for path, digest in sorted(files.items()))
    return "sha256:" + sha256_bytes(joined.encode())


def write_atomically(target: PathLike, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp_dir)``, then move ``tmp_dir`` to ``target``; clean up on any failure."""
    target = Path(target).absolute()
    _check_replaceable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; the export should not be
        write(tmp)
        _fsync_tree(tmp)
        _move_into_place(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _check_replaceable(target: Path) -> None:
    if target.is_file() or target.is_symlink():
        raise ExportError(f"{target} is a file; give a directory path for the export")
    if target.is_dir() and any(target.iterdir()) and not (target / MANIFEST).is_file():
        raise ExportError(
            f"{target} exists and is not an fxckpt export (no {MANIFEST}); refusing to replace "
            "it. Choose a new or empty directory"
        )


def _move_into_place(tmp: Path, target: Path) -> None:
    if not target.exists():
        os.rename(tmp, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rename(target, old / "export")
    os.rename(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def as_key(key: Union[str, bytes, bytearray, None]) -> Optional[bytes]:
    """A ``key=`` argument as bytes (text is UTF-8 encoded); ``None`` stays ``None``."""
    if key is None:
        return None
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, (bytes, bytearray)) or not key:
        raise ExportError("key must be a non-empty str or bytes "
                          f"(got {type(key).__name__} {key!r:.40})")
    return bytes(key)


def manifest_mac(manifest: dict[str, Any], key: bytes) -> str:
    """HMAC-SHA256 under ``key`` of the manifest without its ``mac`` (canonical JSON)."""
    signed = {k: v for k, v in manifest.items() if k != "mac"}
    message = json.dumps(signed, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def write_export(tmp: Path, texts: dict[str, str], tensors: dict[str, torch.Tensor],
                 versions: dict[str, str], key: Optional[bytes] = None) -> None:
    """Write every file into ``tmp``, then the manifest that lists them (signed with ``key``)."""
    files: dict[str, str] = {}
    for rel, text in texts.items():
        files[rel] = _write(tmp, rel, text.encode())
    rel, data = weights_bytes(tensors)
    files[rel] = _write(tmp, rel, data)
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "versions": versions,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files,
                "content_hash": content_hash(files)}
    if key is not None:
        manifest["mac"] = {"algorithm": MAC_ALGORITHM, "value": manifest_mac(manifest, key)}
    _write(tmp, MANIFEST, json.dumps(manifest, indent=2).encode())


def _write(root: Path, rel: str, data: bytes) -> str:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return sha256_bytes(data)


class Verified:
    """An export directory whose every file matched its manifest hash."""

    def __init__(self, root: Path, manifest: dict[str, Any],
                 max_json_bytes: int = MAX_JSON_BYTES) -> None:
        self.root = root
        self.manifest = manifest
        self.files: dict[str, str] = manifest["files"]
        self.max_json_bytes = max_json_bytes

    def read_text(self, rel: str) -> str:
        """A listed text file, size-capped, hash-checked again on the very bytes returned."""
        path = self.root / self._listed(rel)
        _check_size(self.root, rel, self.max_json_bytes)
        data = path.read_bytes()
        if sha256_bytes(data) != self.files[rel]:
            raise ExportError.hash_mismatch(self.root, f"the sha256 of {rel}")
        return data.decode()

    def tensors(self, *, max_bytes: Optional[int] = None, use_mmap: bool = False,
                legacy: bool = False) -> dict[str, torch.Tensor]:
        """The weights, read once and checked on the bytes in use (:mod:`fxckpt.export.weights`).
        """
        rel = next((r for r in self.files if r.startswith("weights.")), None)
        if rel is None:
            raise ExportError(f"export {self.root} lists no weights file")
        return read_weights(self.root / self._listed(rel), rel, self.files[rel],
                            max_bytes=max_bytes, use_mmap=use_mmap, legacy=legacy)

    def _listed(self, rel: str) -> str:
        if rel not in self.files:
            raise ExportError(
                f"export {self.root} refers to {rel!r}, which its manifest does not list"
            )
        return rel


def verify(path: PathLike, key: Optional[bytes] = None,
           max_json_bytes: int = MAX_JSON_BYTES) -> Verified:
    """Check the manifest's MAC (with ``key``), that the directory holds exactly the files it
    lists, and every file's hash; :class:`ExportError` on any difference."""
    root = Path(path)
    if not root.is_dir():
        raise ExportError(f"no fxckpt export at {root}: not a directory")
    manifest = _read_manifest(root, max_json_bytes)
    _check_mac(root, manifest, key)
    files = manifest["files"]
    _check_unlisted(root, files)
    for rel, digest in files.items():
        if not isinstance(rel, str) or not isinstance(digest, str):
            raise ExportError(f"export {root} is corrupted: {MANIFEST} lists a file that is not "
                              "path: sha256")
        _check_relative(root, rel)
        if not (root / rel).is_file():
            raise ExportError(f"export {root} is incomplete: {rel} is missing")
        if rel.endswith(".json"):
            _check_size(root, rel, max_json_bytes)
        if not rel.startswith("weights.") and _sha256_file(root / rel) != digest:
            # the weights are checked as they are read
            raise ExportError.hash_mismatch(root, f"the sha256 of {rel}")
    if manifest.get("content_hash") != content_hash(files):
        raise ExportError.hash_mismatch(root, "its content hash")
    return Verified(root, manifest, max_json_bytes)


def _check_size(root: Path, rel: str, limit: int) -> None:
    size = (root / rel).stat().st_size
    if size > limit:
        raise ExportError(f"export {root}: {rel} is {size} bytes, over the {limit} bytes "
                          "a JSON file of an export may have (fxckpt.load(max_json_bytes=) "
                          "raises the cap for an export you trust)")


def _check_unlisted(root: Path, files: dict[str, Any]) -> None:
    """The folder is the manifest: a file it does not list (a ``payload.py`` beside the graphs)
    is refused, never read or put on ``sys.path``."""
    listed = {MANIFEST, *files}
    for folder, dirs, names in os.walk(root, followlinks=False):
        here = Path(folder).relative_to(root)
        for name in [*names, *(d for d in dirs if (Path(folder) / d).is_symlink())]:
            rel = (here / name).as_posix()
            if rel not in listed:
                raise ExportError(f"export {root} holds {rel}, which its manifest does not list; "
                                  "an export is exactly the files its manifest lists (remove "
                                  "the file, or save the module again)")


def _read_manifest(root: Path, max_json_bytes: int) -> dict[str, Any]:
    try:
        _check_size(root, MANIFEST, max_json_bytes)
        manifest = json.loads((root / MANIFEST).read_text())
    except FileNotFoundError:
        raise ExportError(
            f"no fxckpt export at {root}: {MANIFEST} is missing (an interrupted save leaves none)"
        ) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ExportError(
            f"export {root} is corrupted: {MANIFEST} is not valid JSON ({e})"
        ) from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        raise ExportError(
            f"{root} is not an fxckpt export: {MANIFEST} has no format {FORMAT!r} and file list"
        )
    version = manifest.get("format_version", 0)
    if version in (1, 2):
        what = ("whose graphs are Python code" if version == 1 else
                "whose loader checked what a graph calls against a list of dangerous families")
        raise ExportError(f"export {root} has format version {version}, {what}; this fxckpt "
                          f"reads version {FORMAT_VERSION}, checked against a closed allowlist. "
                          "Re-save it: transform the model with this fxckpt and call "
                          "fxckpt.save(tm, path) (a loaded export cannot be saved again)")
    if version != FORMAT_VERSION:
        raise ExportError(f"export {root} has format version {str(version)[:20]}; this fxckpt "
                          f"reads version {FORMAT_VERSION} (upgrade fxckpt for a newer one)")
    return manifest


def _check_mac(root: Path, manifest: dict[str, Any], key: Optional[bytes]) -> None:
    """A keyed export needs its key; a key needs a keyed export (a forger would drop the MAC)."""
    mac = manifest.get("mac")
    if key is None:
        if mac is not None:
            raise ExportError(f"export {root} was saved with a key (its manifest has an HMAC): "
                              "pass the same key= to fxckpt.load to check that it is the export "
                              "you saved")
        return
    if mac is None:
        raise ExportError(f"export {root} has no MAC, but key= was given: it was saved without "
                          "a key, or someone removed the MAC; refusing to load it as authentic")
    if not (isinstance(mac, dict) and mac.get("algorithm") == MAC_ALGORITHM
            and isinstance(mac.get("value"), str)):
        raise ExportError(f"export {root} has a MAC this fxckpt does not know "
                          f"(expected {MAC_ALGORITHM})")
    if not hmac.compare_digest(mac["value"].encode(), manifest_mac(manifest, key).encode()):
        raise ExportError(f"export {root} failed authentication: its MAC does not match (MAC "
                          "mismatch): a file or the manifest was changed after saving, or the key "
                          "is not the one it was saved with")


def _check_relative(root: Path, rel: str) -> None:
    resolved = (root / rel).resolve()
    if (
        Path(rel).is_absolute()
        or ".." in Path(rel).parts
        or root.resolve() not in resolved.parents
    ):
        raise ExportError(f"export {root} lists {rel!r}, which is outside the export directory")


def versions() -> dict[str, str]:
    """Library versions written into the manifest."""
    import sys

    import fxckpt

    out = {
        "fxckpt": fxckpt.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if "transformers" in sys.modules:
        out["transformers"] = getattr(sys.modules["transformers"], "__version__", "?")
    return out
