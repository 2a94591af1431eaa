"""The weights file: written as safetensors, read once into memory the loader owns.

Three promises of :func:`fxckpt.load` live here:

* **The bytes in use are the bytes checked.** The file is read once into a ``bytearray``; its
  SHA-256 is checked on that very buffer (the manifest's hash, which a key's MAC covers), and
  the tensors are views of it. A file swapped, rewritten or truncated after that cannot change
  or crash a loaded module (a memory map would: the first fxckpt did, and a truncated file
  killed the next step with SIGBUS). ``mmap=True`` maps the file instead, for exports too
  large to copy, and is refused with ``key=``.
* **Sizes are checked before anything is allocated.** The safetensors header is parsed by hand:
  every tensor's dtype is one of a fixed table, its byte range lies inside the file, ranges do
  not overlap, and each holds exactly ``numel * itemsize`` bytes; the file must fit in
  ``max_bytes``. So a file can make the loader allocate no more than its own size (plus the
  parsed header), and a small file declaring huge tensors is refused.
* **Only data.** ``weights.pt`` (``torch.save``'s zip of pickles) is refused unless the caller
  opts into the legacy format (``load(..., legacy_weights=True)``), and then only a zip whose
  entries are stored, not compressed (a 1.6 MB compressed file once unpacked to 1.9 GB), is
  read, with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import json
import math
import mmap
import zipfile
from pathlib import Path
from typing import Any, Optional

import torch

from fxckpt.errors import ExportError

__all__ = ["SAFETENSORS", "LEGACY", "weights_bytes", "read_weights", "DTYPES", "MAX_HEADER"]

SAFETENSORS = "weights.safetensors"
LEGACY = "weights.pt"
MAX_HEADER = 100 << 20
"""The largest safetensors header read (safetensors' own limit)."""

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "C64": torch.complex64,
}
"""safetensors dtype names a weights file may use."""
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def weights_bytes(tensors: dict[str, torch.Tensor]) -> tuple[str, bytes]:
    """The weights file of an export: its name and bytes (safetensors, written here)."""
    plain = _unshared(tensors)
    header: dict[str, Any] = {}
    chunks: list[bytes] = []
    offset = 0
    for key in sorted(plain, key=lambda k: -plain[k].element_size()):  # keeps each aligned
        t = plain[key]
        if t.dtype not in _NAMES:
            raise ExportError(f"the tensor {key!r} has dtype {t.dtype}, which an export cannot "
                              f"hold ({', '.join(map(str, _NAMES))})")
        data = ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""
        header[key] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return SAFETENSORS, len(text).to_bytes(8, "little") + text + b"".join(chunks)


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors, none sharing memory with another."""
    out, storages = {}, set()
    for key, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        ptr = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) if t.numel() else None
        if ptr is not None and ptr in storages:
            t = t.clone()
        storages.add(ptr)
        out[key] = t
    return out


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_weights(path: Path, rel: str, expected_sha256: str, *, max_bytes: Optional[int],
                 use_mmap: bool = False, legacy: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of the weights file ``rel`` at ``path``, read as the module docstring says."""
    where = f"{rel} of export {path.parent}"
    if rel == LEGACY and not legacy:
        raise ExportError(f"{where}: the export holds torch.save weights (a zip of pickles); "
                          "fxckpt saves safetensors. Load it with legacy_weights=True if you "
                          "trust where it came from, and save it again")
    if rel not in (SAFETENSORS, LEGACY):
        raise ExportError(f"{where}: not a weights file fxckpt reads")
    size = path.stat().st_size
    if max_bytes is not None and size > max_bytes:
        raise ExportError(f"{where} holds {size} bytes, more than max_bytes={max_bytes} (by "
                          "default twice the tensor bytes the export declares); pass a larger "
                          "max_bytes= if you expect it")
    buffer: Any
    if use_mmap:
        with open(path, "rb") as f:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else bytearray()
    else:
        buffer = _aligned_read(path, size, where)
    if sha256_bytes(buffer) != expected_sha256:
        raise ExportError.hash_mismatch(path.parent, f"the sha256 of {rel}")
    if rel == LEGACY:
        return _legacy(bytes(buffer), where, max_bytes)
    return _safetensors(buffer, where, align=1 if use_mmap else ALIGN)


ALIGN = 64
"""Bytes every loaded tensor's data is aligned to: CPU kernels (oneDNN convolutions on one
thread) take other code paths, and round differently, for data that is not; a loaded module
must compute the bits the model did."""


def _aligned_read(path: Path, size: int, where: str) -> memoryview:
    """The file read once into memory whose tensor data starts on an :data:`ALIGN` boundary
    (torch's CPU allocator aligns to 64; the data follows an 8-byte length and the header)."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        start = 8 + min(n, size)
        store = (ctypes.c_char * (size + ALIGN))()  # kept alive by the view below
        pad = (-(ctypes.addressof(store) + start)) % ALIGN
        view = memoryview(store).cast("B")[pad:pad + size]
        view[:len(head)] = head
        if f.readinto(view[len(head):]) != size - len(head):
            raise ExportError(f"{where} changed size while it was read")
    return view


def _safetensors(buffer: Any, where: str, align: int = ALIGN) -> dict[str, torch.Tensor]:
    if len(buffer) < 8:
        raise ExportError(f"{where} is not a safetensors file: it is {len(buffer)} bytes long")
    n = int.from_bytes(buffer[:8], "little")
    if n > min(MAX_HEADER, len(buffer) - 8):
        raise ExportError(f"{where} declares a header of {n} bytes, more than the file holds "
                          "(truncated or forged)")
    try:
        header = json.loads(bytes(buffer[8:8 + n]))
    except (ValueError, UnicodeDecodeError) as e:
        raise ExportError(f"{where}: its header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ExportError(f"{where}: its header is not a table of tensors")
    base, length = 8 + n, len(buffer) - 8 - n
    spans: list[tuple[int, int, str]] = []
    layout: dict[str, tuple[torch.dtype, list[int], int, int]] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        dtype, shape, begin, end = _entry(key, entry, length, where)
        spans.append((begin, end, key))
        layout[key] = (dtype, shape, begin, end)
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise ExportError(f"{where}: the tensors {first!r} and {second!r} overlap")
    out = {}
    for key, (dtype, shape, begin, end) in layout.items():
        out[key] = _tensor(buffer, base + begin, end - begin, dtype, shape, f"{where}: {key!r}",
                           align)
    return out


def _entry(key: Any, entry: Any, length: int,
           where: str) -> tuple[torch.dtype, list[int], int, int]:
    at = f"{where}: the tensor {str(key)[:80]!r}"
    if not isinstance(entry, dict):
        raise ExportError(f"{at} is not described by a table")
    name = entry.get("dtype")
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if dtype is None:
        raise ExportError(f"{at} has dtype {str(entry.get('dtype'))[:20]!r}, not one of "
                          f"{', '.join(DTYPES)}")
    if not (isinstance(shape, list) and all(_count(d) for d in shape) and len(shape) <= 64):
        raise ExportError(f"{at} has an invalid shape {str(shape)[:80]}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_count, offsets))):
        raise ExportError(f"{at} has invalid data offsets {str(offsets)[:80]}")
    begin, end = offsets
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not begin <= end <= length or end - begin != nbytes:
        raise ExportError(f"{at} declares {nbytes} bytes at [{begin}, {end}), which do not fit "
                          f"the {length} bytes of data the file holds (truncated or forged)")
    return dtype, shape, begin, end


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def _tensor(buffer: Any, offset: int, nbytes: int, dtype: torch.dtype, shape: list[int],
            where: str, align: int = ALIGN) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)
    if dtype == torch.bool and bool((raw > 1).any()):
        raise ExportError(f"{where} holds booleans other than 0 and 1")
    size = raw.new_empty((), dtype=dtype).element_size()
    if raw.data_ptr() % max(align, size):  # mapped files: aligned for the dtype only
        raw = raw.clone()  # a copy of its own, aligned as the model's tensors were (ALIGN)
    return raw.view(dtype).reshape(shape)


def _legacy(data: bytes, where: str, max_bytes: Optional[int]) -> dict[str, torch.Tensor]:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            infos = z.infolist()
    except zipfile.BadZipFile as e:
        raise ExportError(f"{where} is not a torch.save zip file ({e})") from None
    unpacked = sum(i.file_size for i in infos)
    limit = max_bytes if max_bytes is not None else 2 * len(data)
    if any(i.compress_type != zipfile.ZIP_STORED for i in infos) or unpacked > limit:
        raise ExportError(f"{where} unpacks to {unpacked} bytes from {len(data)} (compressed "
                          "entries, or more than max_bytes): refused before unpacking")
    try:
        tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # torch's unpickler raises many kinds of errors on forged data
        raise ExportError(f"{where} cannot be read as weights ({type(e).__name__}: "
                          f"{str(e)[:200]})") from None
    if not (isinstance(tensors, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in tensors.items())):
        raise ExportError(f"{where} does not hold a table of named tensors")
    return tensors
