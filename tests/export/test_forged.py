"""Forged exports: whoever can write an export's files can recompute every hash, so loading
must refuse anything that is not data it understands, before running or importing anything,
allocating more than the file honestly declares, or crashing (fxckpt/export).

Each crafted case edits one file of a valid export and recomputes the manifest's hashes (what a
forger can do without the key), then expects an :class:`ExportError` naming the file or node.
The corpus covers every class of attack the audit found: dotted and builtin call targets, module
attributes that ``nn.Module.__call__`` reads from the instance (``_call_impl = getattr`` once
walked to ``exec``), ATen operators that skip validation or touch files or raw memory, strings
torch.fx prints into generated code, pytree types torch's reader would import, forged
safetensors headers (truncated, huge, overlapping, wrong dtypes, non-boolean booleans), legacy
pickled weights and zip bombs; then random mutations of valid files.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import fxckpt
from crafting import (EVIL, OPEN, ROOT, SEGMENT, STRUCTURE, Change, X, call, leaf, pytree_args,
                      set_node, spec_of)
from fxckpt.export import ExportError, LoadedModule
from models import MLP

NOT_LISTED = "not on fxckpt's allowlist of what a loaded export may call"
CRAFTED: dict[str, tuple[str, Change, str]] = {
    # call targets: dotted names, builtins, the attacker's module, ATen ops that touch files
    "dotted_name": (ROOT, call("torch.serialization.os.system", "touch MARKER"),
                    NOT_LISTED),
    "os_system": (ROOT, call("os.system", "touch MARKER"), NOT_LISTED),
    "builtins_exec": (ROOT, call("builtins.exec", OPEN), NOT_LISTED),
    "builtins_open": (ROOT, call("builtins.open", "MARKER", "w"), NOT_LISTED),
    "own_module": (ROOT, call(f"{EVIL}.run"), NOT_LISTED),
    "aten_save": (SEGMENT, call("torch.ops.aten.save.default", X, "MARKER"), NOT_LISTED),
    "aten_from_file": (SEGMENT, call("torch.ops.aten.from_file.default", "MARKER"),
                       "may never call"),
    "getattr_dunder": (SEGMENT, call("builtins.getattr", X, "__class__"),
                       "reads the attribute '__class__'"),
    "method_hook": (SEGMENT, set_node("call_module", op="call_method", target="register_hook"),
                    "method 'register_hook'"),
    # strings that torch.fx prints into the code it generates
    "node_name": (ROOT, set_node("placeholder", name=f"x = {OPEN}#"), "node name must be"),
    "placeholder": (ROOT, set_node("placeholder", target=f"x={OPEN}"), "must be an argument name"),
    "module_path": (ROOT, set_node("get_attr", target=f'a")or {OPEN} or("'),
                    "not a path of the module's own attributes"),
    "attribute_walk": (ROOT, set_node("get_attr", target="training"),
                       "not a module, parameter, buffer or tensor the export holds"),
    "class_walk": (ROOT, set_node("get_attr", target="__class__.__init__.__globals__"),
                   "not a path of the module's own attributes"),
    "kwarg_name": (ROOT, set_node("call_function", kwargs={f"x={OPEN},y": 1}), "keyword argument"),
    "pytree_args": (ROOT, pytree_args(f"x={OPEN}"), "argument names must be identifiers"),
    # structure.json: classes, attribute values and pytree types
    "leaf_class": (STRUCTURE, leaf(cls=f"{EVIL}:Evil"), "not one of the torch.nn module"),
    "function_attr": (STRUCTURE, leaf(attrs={"in_features": {"__function__": "os.system"}}),
                      "may hold a torch tensor function only"),
    "dtype_attr": (STRUCTURE, leaf(attrs={"in_features": {"__dtype__": "load"}}),
                   "unknown dtype"),
    "spec_type": (STRUCTURE, spec_of(f"{EVIL}.Evil", None), "pytree node type"),
    "spec_defaultdict": (STRUCTURE, spec_of("collections.defaultdict", {
        "default_factory_module": EVIL, "default_factory_name": "run", "dict_context": []}),
        "pytree node type 'collections.defaultdict'"),
    "spec_enum": (STRUCTURE, spec_of("builtins.dict", [{"__enum__": True, "fqn": f"{EVIL}:Evil",
                                                      "name": "x"}]), "holds a JSON object"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_exports_are_refused_before_anything_runs(forge: Any, case: str) -> None:
    rel, change, message = CRAFTED[case]
    forge.edit(rel, lambda data: change(data, str(forge.marker)))
    with pytest.raises(ExportError, match=re.escape(message)):
        fxckpt.load(forge.root)


def test_an_export_with_generated_code_is_refused(forge: Any) -> None:
    """Format 1 held Python files and dotted import names; none of it is read any more."""
    code = f"import pathlib\npathlib.Path({str(forge.marker)!r}).write_text('x')\n"
    forge.edit("code/v0/root.py", lambda _: code + "def forward(self, x):\n    return x\n")
    dotted = {"torch": {"from": "torch", "name": "serialization.os.system"}}
    forge.edit(STRUCTURE, lambda s: s["variants"][0]["modules"][0].update(
        code="code/v0/root.py", globals=dotted))
    manifest = json.loads((forge.root / "manifest.json").read_text())
    manifest["format_version"] = 1
    (forge.root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match="format version 1, whose graphs are Python code"):
        fxckpt.load(forge.root)


def test_an_export_of_format_2_is_refused_with_how_to_save_it_again(forge: Any) -> None:
    """Format 2 was loaded against a denylist; its graphs may call what the allowlist holds not."""
    manifest = json.loads((forge.root / "manifest.json").read_text())
    manifest["format_version"] = 2
    (forge.root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match=r"format version 2, whose loader checked .* Re-save "
                       r"it: transform the model with this fxckpt and call fxckpt.save"):
        fxckpt.load(forge.root)


# -- module attributes nn.Module.__call__ or forward read from the instance --------------------

LINEAR = "the attribute name '{}' is not one an export may set on a Linear"
FUNCTION_ONLY = "a saved module's attribute may hold a torch tensor function only"
UNCHECKED = "builds tensors from data without checking it, or points a tensor at other memory"


def _attr(name: str, value: Any) -> Change:
    return leaf(attrs={name: value})


GETATTR = {"__function__": "builtins.getattr"}
CRAFTED.update({
    "call_impl_getattr": (STRUCTURE, _attr("_call_impl", GETATTR), LINEAR.format("_call_impl")),
    "compiled_call_impl": (STRUCTURE, _attr("_compiled_call_impl", {"__function__": "torch.relu"}),
                           LINEAR.format("_compiled_call_impl")),
    "forward_attr": (STRUCTURE, _attr("forward", {"__function__": "torch.relu"}),
                     LINEAR.format("forward")),
    "method_attr": (STRUCTURE, _attr("extra_repr", 1), LINEAR.format("extra_repr")),
    "property_attr": (STRUCTURE, _attr("T_destination", 1), LINEAR.format("T_destination")),
    "attr_getattr": (STRUCTURE, _attr("in_features", GETATTR), FUNCTION_ONLY),
    "attr_setitem": (STRUCTURE, _attr("in_features", {"__function__": "operator.setitem"}),
                     FUNCTION_ONLY),
    "attr_checkpoint": (STRUCTURE, _attr("in_features", {"__function__": "fxckpt.checkpoint"}),
                        FUNCTION_ONLY),
    # ATen operators, functions and methods that skip validation or point at other memory
    "aten_sparse_unchecked": (SEGMENT, call(
        "torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors.default", 1, 1, [4], X, X),
        UNCHECKED),
    "aten_sparse_coo": (SEGMENT, call("torch.ops.aten.sparse_coo_tensor.indices", X, X),
                        UNCHECKED),
    "aten_sparse_csr": (SEGMENT, call("torch.ops.aten._sparse_csr_tensor_unsafe.default", X, X,
                                       X, [2, 2]), UNCHECKED),
    "aten_set_": (SEGMENT, call("torch.ops.aten.set_.source_Tensor", X, X), UNCHECKED),
    "aten_as_strided": (SEGMENT, call("torch.ops.aten.as_strided.default", X, [9999], [1], 9999),
                        UNCHECKED),
    "aten_unsafe_index": (SEGMENT, call("torch.ops.aten._unsafe_index.Tensor", X, [X]),
                          UNCHECKED),
    "aten_index_put_unsafe": (SEGMENT, call("torch.ops.aten._index_put_impl_.default", X, [X], X,
                                             False, True), UNCHECKED),
    "aten_nested": (SEGMENT, call("torch.ops.aten._nested_view_from_buffer.default", X, X, X, X),
                    UNCHECKED),
    "function_sparse": (SEGMENT, call("torch.sparse_coo_tensor", X, X), UNCHECKED),
    "function_set_": (SEGMENT, call("torch.Tensor.set_", X, X), "may never call"),
    "method_set_": (SEGMENT, set_node("call_module", op="call_method", target="set_"),
                    "method 'set_'"),
    "method_to_sparse": (SEGMENT, set_node("call_module", op="call_method", target="to_sparse"),
                         "method 'to_sparse'"),
    "method_as_strided": (SEGMENT, set_node("call_module", op="call_method", target="as_strided"),
                          "method 'as_strided'"),
})


def _set_into_module(target: str) -> Change:
    """The checkpoint call now writes its argument into the segment module it was to run."""
    def change(program: dict, marker: str) -> None:
        node = next(n for n in program["nodes"]
                    if n["op"] == "call_function" and n["target"] == "fxckpt.checkpoint")
        node["target"] = target
        node["args"] = [node["args"][0], "forward", node["args"][1]]
    return change


CRAFTED.update({
    "setitem_module": (ROOT, _set_into_module("operator.setitem"), "passes the module"),
    "delitem_module": (ROOT, _set_into_module("operator.delitem"), "passes the module"),
})


# -- the weights file -------------------------------------------------------------------------

WEIGHTS = "weights.safetensors"


def _header(data: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def _with_header(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + body


def _retensor(change: Callable[[dict], None]) -> Callable[[bytes], bytes]:
    """Edit the first tensor's entry of the safetensors header."""
    def edit(data: bytes) -> bytes:
        header, body = _header(data)
        change(header[next(k for k in header if k != "__metadata__")])
        return _with_header(header, body)
    return edit


def _two_overlap(data: bytes) -> bytes:
    header, body = _header(data)
    a, b = [k for k in header if k != "__metadata__"][:2]
    header[b]["data_offsets"] = list(header[a]["data_offsets"])
    header[b]["shape"], header[b]["dtype"] = header[a]["shape"], header[a]["dtype"]
    return _with_header(header, body)


def _bad_booleans(data: bytes) -> bytes:
    header, body = _header(data)
    entry = header[next(k for k in header if k != "__metadata__")]
    begin, end = entry["data_offsets"]
    entry["dtype"], entry["shape"] = "BOOL", [end - begin]
    return _with_header(header, body[:begin] + b"\x07" * (end - begin) + body[end:])


WEIGHT_CASES: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "truncated": (lambda d: d[: len(d) // 2], "do not fit"),
    "empty": (lambda d: b"", "is not a safetensors file"),
    "huge_header": (lambda d: (1 << 40).to_bytes(8, "little") + d[8:], "declares a header of"),
    "header_not_json": (lambda d: (5).to_bytes(8, "little") + b"{{{{{" + d[13:],
                        "its header is not valid JSON"),
    "header_not_table": (lambda d: (2).to_bytes(8, "little") + b"[]", "is not a table of tensors"),
    "bomb": (_retensor(lambda e: e.update(shape=[1 << 30], data_offsets=[0, 4 << 30])),
             "do not fit"),
    "offsets_past_end": (_retensor(lambda e: e.update(data_offsets=[1 << 40, 1 << 41])),
                         "do not fit"),
    "size_mismatch": (_retensor(lambda e: e.update(shape=[1])), "do not fit"),
    "negative_shape": (_retensor(lambda e: e.update(shape=[-4, 8])), "invalid shape"),
    "float_shape": (_retensor(lambda e: e.update(shape=[2.5])), "invalid shape"),
    "bad_offsets": (_retensor(lambda e: e.update(data_offsets="0-4")), "invalid data offsets"),
    "unknown_dtype": (_retensor(lambda e: e.update(dtype="F128")), "has dtype 'F128'"),
    "entry_not_table": (_retensor(lambda e: e.clear()), "has dtype"),
    "overlap": (_two_overlap, "overlap"),
    "bad_booleans": (_bad_booleans, "booleans other than 0 and 1"),
}


@pytest.mark.parametrize("case", list(WEIGHT_CASES))
def test_forged_weights_are_refused_before_they_are_allocated(forge: Any, case: str) -> None:
    change, message = WEIGHT_CASES[case]
    forge.edit_bytes(WEIGHTS, change)
    with pytest.raises(ExportError, match=re.escape(message)) as e:
        fxckpt.load(forge.root)
    assert WEIGHTS in str(e.value)


def _pickled(tensors: dict, compress: bool = False) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(tensors, buf)
    if not compress:
        return buf.getvalue()
    out = io.BytesIO()  # the same entries, deflated: what a zip bomb does
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, \
            zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    return out.getvalue()


def test_pickled_weights_are_refused_unless_asked_for_and_never_compressed(forge: Any) -> None:
    tensors = fxckpt.load(forge.root).state_dict()
    forge.put("weights.pt", _pickled(dict(tensors)), replaces=WEIGHTS)
    with pytest.raises(ExportError, match=r"weights.pt of export .* torch.save weights"):
        fxckpt.load(forge.root)
    loaded = fxckpt.load(forge.root, legacy_weights=True)  # the legacy format, on request
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in tensors.items())
    bomb = {k: torch.zeros(1 << 22) for k in ("a", "b")}  # 32 MiB of zeros, a few KiB deflated
    forge.put("weights.pt", _pickled(bomb, compress=True))
    with pytest.raises(ExportError, match="compressed entries, or more than max_bytes"):
        fxckpt.load(forge.root, legacy_weights=True)


def test_a_weights_file_larger_than_max_bytes_is_refused_before_it_is_read(forge: Any) -> None:
    size = (forge.root / WEIGHTS).stat().st_size
    with pytest.raises(ExportError, match=rf"holds {size} bytes, more than max_bytes=100"):
        fxckpt.load(forge.root, max_bytes=100)
    forge.edit_bytes(WEIGHTS, lambda d: d + b"\0" * (4 << 20))  # padding the header allows
    with pytest.raises(ExportError, match="more than max_bytes="):
        fxckpt.load(forge.root)  # default: twice the tensor bytes the export declares


# -- random mutations -------------------------------------------------------------------------

NASTY = ["__class__", "_call_impl", "builtins.getattr", "os.system", "../../etc/passwd",
         "x" * 5000, -1, 2**70, 1.5, None, [], {}, {"__function__": "builtins.eval"},
         {"__node__": "nope"}, {"__dtype__": "float32"}, "torch.ops.aten.set_.source_Tensor",
         "aten::from_file", "\x00", True]


def _mutate(data: Any, rng: random.Random) -> Any:
    """Replace one value somewhere in the JSON tree by a nasty one."""
    spots: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) \
            if isinstance(node, list) else ()
        for k, v in items:
            spots.append((node, k))
            walk(v)

    walk(data)
    node, key = rng.choice(spots)
    node[key] = rng.choice(NASTY)
    return data


@pytest.mark.parametrize("seed", range(24))
def test_random_mutations_load_or_are_refused_never_anything_else(forge: Any,
                                                                    seed: int) -> None:
    rng = random.Random(seed)
    rel = rng.choice([STRUCTURE, ROOT, SEGMENT])
    forge.edit(rel, lambda data: _mutate(data, rng) and None)
    try:
        loaded = fxckpt.load(forge.root)
    except ExportError as e:
        assert re.search(r"structure\.json|programs/v0/|node '|the module at|weights|manifest",
                         str(e)), str(e)
    else:
        assert isinstance(loaded, LoadedModule)  # the mutation was still valid data


# -- what every refusal promises ----------------------------------------------------------------

def test_every_refusal_names_its_file_or_node(forge: Any) -> None:
    for case, (rel, change, message) in CRAFTED.items():
        shutil.copytree(forge.root, forge.root.parent / case)
        original = forge.root
        forge.root = forge.root.parent / case
        try:
            forge.edit(rel, lambda data, c=change: c(data, str(forge.marker)))
            with pytest.raises(ExportError) as e:
                fxckpt.load(forge.root)
        finally:
            forge.root = original
        places = r"structure\.json|programs/v0/|node '|the module at|code/v0"
        assert re.search(places, str(e.value)), (case, str(e.value))


BOMBS = '''
import resource, sys, torch
sys.path.insert(0, {tests!r})
import fxckpt
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
refused = 0
for path in {paths!r}:
    try:
        fxckpt.load(path)
    except fxckpt.FxckptError:
        refused += 1
print(refused, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
'''


def test_bombs_are_refused_with_the_resident_memory_of_a_small_export(forge: Any,
                                                                       tmp_path: Path) -> None:
    paths = []
    for i, shape in enumerate(([1 << 30], [1 << 28, 64], [1 << 40])):
        target = tmp_path / f"bomb{i}"
        nbytes = 4 * int(torch.tensor(shape).prod())
        with forge.copy(target):
            forge.edit_bytes(WEIGHTS, _retensor(
                lambda e, s=shape, n=nbytes: e.update(shape=s, data_offsets=[0, n])))
        paths.append(str(target))
    tests = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", BOMBS.format(tests=tests, paths=paths)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    refused, grown_kib = map(int, out.stdout.split())
    assert refused == len(paths)
    assert grown_kib < 64 << 10, f"loading the bombs grew resident memory by {grown_kib} KiB"


# -- keyed loads use the bytes the key checked ----------------------------------------------------

def test_a_keyed_load_is_refused_or_unaffected_while_the_file_is_swapped(tmp_path: Path) -> None:
    import threading

    x = torch.randn(4, 32)
    tm = fxckpt.transform(MLP(depth=2), every=1, example_inputs=(x,))
    fxckpt.save(tm, tmp_path / "k", key="s3cret")
    weights = tmp_path / "k" / WEIGHTS
    good = weights.read_bytes()
    header, body = _header(good)
    evil = _with_header(header, bytes(len(body)))  # same layout, all-zero weights
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            for data in (evil, good):  # staged beside the export: it holds only listed files
                tmp = tmp_path / "weights.swap"
                tmp.write_bytes(data)
                os.replace(tmp, weights)

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    outcomes = {"loaded": 0, "refused": 0}
    try:
        for _ in range(30):
            try:
                loaded = fxckpt.load(tmp_path / "k", key="s3cret")
            except ExportError as e:
                assert "hash mismatch" in str(e) or "changed size" in str(e)
                outcomes["refused"] += 1
            else:
                for (k, p), q in zip(loaded.named_parameters(), tm.parameters()):
                    assert torch.equal(p, q), k  # never the swapped-in zeros
                outcomes["loaded"] += 1
    finally:
        stop.set()
        swapper.join()
    assert outcomes["loaded"] + outcomes["refused"] == 30


def test_a_loaded_module_owns_its_weights(tmp_path: Path) -> None:
    x = torch.randn(4, 32)
    tm = fxckpt.transform(MLP(depth=2), every=1, example_inputs=(x,))
    for key in (None, "k"):
        path = tmp_path / f"m{key}"
        fxckpt.save(tm, path, key=key)
        loaded = fxckpt.load(path, key=key)
        before = [p.detach().clone() for p in loaded.parameters()]
        weights = path / WEIGHTS
        weights.write_bytes(bytes(weights.stat().st_size))  # rewritten after the load
        assert all(torch.equal(p, q) for p, q in zip(loaded.parameters(), before))
        weights.write_bytes(b"")  # truncated: a memory map would die with SIGBUS here
        loaded(x).sum().backward()
    with pytest.raises(fxckpt.ConfigError, match="mmap=True cannot be combined with key="):
        fxckpt.load(tmp_path / "mk", key="k", mmap=True)


def test_mmap_maps_the_file_and_trains(tmp_path: Path) -> None:
    x = torch.randn(4, 32)
    tm = fxckpt.transform(MLP(depth=2), every=1, example_inputs=(x,))
    fxckpt.save(tm, tmp_path / "m")
    loaded = fxckpt.load(tmp_path / "m", mmap=True)
    for (k, p), q in zip(loaded.named_parameters(), tm.parameters()):
        assert torch.equal(p, q), k
    loaded(x).sum().backward()
    torch.optim.SGD(loaded.parameters(), lr=0.1).step()  # copy-on-write: the file stays


def test_weights_fxckpt_writes_are_safetensors_the_library_reads(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    tm = fxckpt.transform(MLP(depth=2), every=1, example_inputs=(torch.randn(4, 32),))
    fxckpt.save(tm, tmp_path / "m")
    theirs = safetensors.load_file(str(tmp_path / "m" / WEIGHTS))
    ours = fxckpt.load(tmp_path / "m").state_dict()
    assert sorted(theirs) and all(any(torch.equal(t, v) for v in ours.values())
                                  for t in theirs.values())


def test_an_export_saved_on_a_gpu_needs_map_location_here(forge: Any) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    forge.edit(STRUCTURE, lambda s: s["devices"].update({k: "cuda:0" for k in s["devices"]}))
    with pytest.raises(ExportError, match=r"saved on cuda:0, which this machine does not have; "
                                          r"pass map_location='cpu'"):
        fxckpt.load(forge.root)
    assert isinstance(fxckpt.load(forge.root, map_location="cpu"), LoadedModule)
    with pytest.raises(fxckpt.ConfigError, match="map_location must be a device"):
        fxckpt.load(forge.root, map_location="nonsense")
