"""export/weights.py: the weights file, written as safetensors here and read back once into
memory the loader owns, checked by hash and by header before anything is allocated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fxckpt.export import ExportError
from fxckpt.export.weights import LEGACY, SAFETENSORS, read_weights, sha256_bytes, weights_bytes


def _write(tmp_path: Path, data: bytes, rel: str = SAFETENSORS) -> Path:
    path = tmp_path / rel
    path.write_bytes(data)
    return path


def _read(path: Path, data: bytes, **options) -> dict[str, torch.Tensor]:
    options.setdefault("max_bytes", None)
    return read_weights(path, path.name, sha256_bytes(data), **options)


TENSORS = {"fc.weight": torch.randn(3, 4), "fc.bias": torch.randn(3).double(),
           "mask": torch.tensor([True, False]), "steps": torch.tensor(7),
           "empty": torch.zeros(0, 2, dtype=torch.int8)}


@pytest.mark.parametrize("use_mmap", [False, True])
def test_tensors_round_trip_bit_for_bit(tmp_path: Path, use_mmap: bool) -> None:
    rel, data = weights_bytes(TENSORS)
    assert rel == SAFETENSORS
    back = _read(_write(tmp_path, data), data, use_mmap=use_mmap)
    assert back.keys() == TENSORS.keys()
    for key, t in TENSORS.items():
        assert back[key].dtype == t.dtype and torch.equal(back[key], t), key


def test_the_header_is_safetensors_and_the_data_starts_8_byte_aligned() -> None:
    _, data = weights_bytes({"a": torch.ones(2, dtype=torch.float16), "b": torch.ones(1)})
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    assert n % 8 == 0
    assert header == {"b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                      "a": {"dtype": "F16", "shape": [2], "data_offsets": [4, 8]}}


def test_shared_tensors_are_written_twice_and_read_back_apart(tmp_path: Path) -> None:
    weight = torch.randn(2, 2)
    _, data = weights_bytes({"a": weight, "b": weight})
    back = _read(_write(tmp_path, data), data)
    assert torch.equal(back["a"], back["b"])
    assert back["a"].data_ptr() != back["b"].data_ptr()


def test_a_dtype_outside_the_table_is_refused() -> None:
    with pytest.raises(ExportError, match=r"^the tensor 'q' has dtype torch.complex128, which an "
                                          r"export cannot hold"):
        weights_bytes({"q": torch.zeros(1, dtype=torch.complex128)})


def test_a_changed_byte_is_a_hash_mismatch(tmp_path: Path) -> None:
    _, data = weights_bytes({"a": torch.ones(4)})
    path = _write(tmp_path, data[:-1] + b"\x01")
    with pytest.raises(ExportError, match=r"the sha256 of weights.safetensors does not match "
                                          r"its manifest \(hash mismatch\)"):
        _read(path, data)


def test_a_file_over_max_bytes_is_refused_before_it_is_read(tmp_path: Path) -> None:
    _, data = weights_bytes({"a": torch.ones(4)})
    with pytest.raises(ExportError, match=f"holds {len(data)} bytes, more than max_bytes=10"):
        _read(_write(tmp_path, data), data, max_bytes=10)


def test_pickled_weights_are_refused_unless_asked_for(tmp_path: Path) -> None:
    path = tmp_path / LEGACY
    torch.save({"a": torch.ones(2)}, path)
    data = path.read_bytes()
    with pytest.raises(ExportError, match="the export holds torch.save weights"):
        _read(path, data)
    assert torch.equal(_read(path, data, legacy=True)["a"], torch.ones(2))


def test_other_file_names_are_not_weights(tmp_path: Path) -> None:
    path = _write(tmp_path, b"", "weights.bin")
    with pytest.raises(ExportError, match="not a weights file fxckpt reads"):
        _read(path, b"")


def _forged(header: dict, body: bytes = b"\0" * 8) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + body


@pytest.mark.parametrize("data, message", [
    (b"abc", "is not a safetensors file: it is 3 bytes long"),
    ((10 ** 6).to_bytes(8, "little") + b"{}", "declares a header of 1000000 bytes"),
    (_forged({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}), "do not fit"),
    (_forged({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}),
     r"declares 8 bytes at \[0, 4\)"),
    (_forged({"a": {"dtype": "PY", "shape": [1], "data_offsets": [0, 1]}}), "has dtype 'PY'"),
    (_forged({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}), "invalid shape"),
    (_forged({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
              "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}), "overlap"),
    (_forged({"m": {"dtype": "BOOL", "shape": [1], "data_offsets": [0, 1]}}, b"\2" * 8),
     "booleans other than 0 and 1"),
], ids=["short", "header", "past_the_end", "numel", "dtype", "shape", "overlap", "booleans"])
def test_a_forged_header_is_refused_before_anything_is_allocated(tmp_path: Path, data: bytes,
                                                                 message: str) -> None:
    with pytest.raises(ExportError, match=message):
        _read(_write(tmp_path, data), data)
