"""The export directory on disk: atomic writing, the manifest, hash checks, weights.

Two promises live here:

* **No half-written export ever loads.** Files are written into a hidden temporary directory
  next to the target, the manifest last, and the directory is renamed into place. A crash
  leaves at most a hidden ``.NAME.tmp-*`` directory without a manifest, which ``load`` refuses.
  Replacing an existing export renames the old one away first; a directory that is not an
  export is never replaced.
* **Nothing corrupted or edited is run.** The manifest lists the SHA-256 of every file and a
  content hash over all of them; ``load`` checks them all before parsing anything, and reads
  code only through :class:`Verified`, from bytes whose hash it has just checked.

    target/
      manifest.json     format, versions, files {path: sha256}, content_hash
      structure.json    plan.json   weights.safetensors (or weights.pt)
      code/v0/*.py      graphs/v0.json
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Union

import torch

from fxckpt.export.codec import ExportError

__all__ = ["FORMAT", "FORMAT_VERSION", "write_atomically", "write_export", "Verified", "verify", "sha256_bytes"]

FORMAT = "fxckpt-export"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PathLike = Union[str, os.PathLike]


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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
        raise ExportError(f"{target} exists and is not an fxckpt export (no {MANIFEST}); refusing to replace it. "
                          "Choose a new or empty directory")


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


def write_export(tmp: Path, texts: dict[str, str], tensors: dict[str, torch.Tensor],
                 versions: dict[str, str]) -> None:
    """Write every file into ``tmp``, then the manifest that lists them."""
    files: dict[str, str] = {}
    for rel, text in texts.items():
        files[rel] = _write(tmp, rel, text.encode())
    rel, data = _weights_bytes(tensors)
    files[rel] = _write(tmp, rel, data)
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "versions": versions,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files,
                "content_hash": content_hash(files)}
    _write(tmp, MANIFEST, json.dumps(manifest, indent=2).encode())


def _write(root: Path, rel: str, data: bytes) -> str:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return sha256_bytes(data)


def _weights_bytes(tensors: dict[str, torch.Tensor]) -> tuple[str, bytes]:
    plain = _unshared(tensors)
    try:
        from safetensors.torch import save
    except ImportError:
        buf = io.BytesIO()
        torch.save(plain, buf)
        return "weights.pt", buf.getvalue()
    return "weights.safetensors", save(plain)


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors, none sharing memory with another (safetensors' rule)."""
    out, storages = {}, set()
    for key, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        ptr = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) if t.numel() else None
        if ptr is not None and ptr in storages:
            t = t.clone()
        storages.add(ptr)
        out[key] = t
    return out


class Verified:
    """An export directory whose every file matched its manifest hash."""

    def __init__(self, root: Path, manifest: dict[str, Any]) -> None:
        self.root = root
        self.manifest = manifest
        self.files: dict[str, str] = manifest["files"]

    def read_text(self, rel: str) -> str:
        """A listed text file, hash-checked again on the very bytes returned."""
        data = (self.root / self._listed(rel)).read_bytes()
        if sha256_bytes(data) != self.files[rel]:
            raise ExportError(_mismatch(self.root, rel))
        return data.decode()

    def tensors(self) -> dict[str, torch.Tensor]:
        rel = next((r for r in self.files if r.startswith("weights.")), None)
        if rel is None:
            raise ExportError(f"export {self.root} lists no weights file")
        path = self.root / self._listed(rel)
        if rel.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)

    def _listed(self, rel: str) -> str:
        if rel not in self.files:
            raise ExportError(f"export {self.root} refers to {rel!r}, which its manifest does not list")
        return rel


def verify(path: PathLike) -> Verified:
    """Check the manifest and every file's hash; raise :class:`ExportError` on any difference."""
    root = Path(path)
    if not root.is_dir():
        raise ExportError(f"no fxckpt export at {root}: not a directory")
    manifest = _read_manifest(root)
    files = manifest["files"]
    for rel, digest in files.items():
        _check_relative(root, rel)
        if not (root / rel).is_file():
            raise ExportError(f"export {root} is incomplete: {rel} is missing")
        if _sha256_file(root / rel) != digest:
            raise ExportError(_mismatch(root, rel))
    if manifest.get("content_hash") != content_hash(files):
        raise ExportError(f"export {root} was modified: its content hash does not match its manifest (hash mismatch)")
    return Verified(root, manifest)


def _read_manifest(root: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except FileNotFoundError:
        raise ExportError(f"no fxckpt export at {root}: {MANIFEST} is missing (an interrupted save leaves none)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ExportError(f"export {root} is corrupted: {MANIFEST} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise ExportError(f"{root} is not an fxckpt export: {MANIFEST} has no format {FORMAT!r} and file list")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise ExportError(f"export {root} has format version {manifest['format_version']}; this fxckpt reads up to "
                          f"{FORMAT_VERSION}: upgrade fxckpt")
    return manifest


def _check_relative(root: Path, rel: str) -> None:
    resolved = (root / rel).resolve()
    if Path(rel).is_absolute() or ".." in Path(rel).parts or root.resolve() not in resolved.parents:
        raise ExportError(f"export {root} lists {rel!r}, which is outside the export directory")


def _mismatch(root: Path, rel: str) -> str:
    return (f"export {root} is corrupted or was modified: {rel} does not match the sha256 in its manifest "
            "(hash mismatch); save the module again")


def versions() -> dict[str, str]:
    """Library versions written into the manifest."""
    import sys

    import fxckpt

    out = {"fxckpt": fxckpt.__version__, "torch": torch.__version__, "python": platform.python_version()}
    if "transformers" in sys.modules:
        out["transformers"] = getattr(sys.modules["transformers"], "__version__", "?")
    return out
