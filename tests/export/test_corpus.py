"""A corpus of crafted exports, one class of attack after another (six classes).

Each case edits a valid export the way anyone who can write its files can (hashes recomputed)
and must be refused with an :class:`ExportError` that names its file or node, without running
code (the forge fixture's marker file), crashing, or taking 10 s:

1. code execution: escape-hatch Tensor methods as calls and as ``call_method`` nodes, names
   off the allowlist that import or run (``torch._utils._import_dotted_name``, ``builtins.eval``),
   and files beside the graphs that the manifest does not list (``payload.py``);
2. memory-unsafe operators: the 13 that crashed the process in the audit and every
   ``*_backward`` and raw-geometry private operator of this torch (a sample of each);
3. storage resized or swapped through a method (``resize_``, ``set_``);
4. containers as leaves (``ParameterDict``) and modules handed to functions that write or return
   them (``operator.setitem``, ``tree_leaves``);
5. memory without bound: allowlisted operators asked for 2 GiB and more, JSON over its cap;
6. the smaller ones: a leaf tensor slot named ``_call_impl``, an LSTM's forged
   ``_flat_weights_names``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import fxckpt
from crafting import ROOT, SEGMENT, STRUCTURE, Change, X, call, leaf, rehash
from fxckpt.export import ExportError
from fxckpt.export.allowlist import ESCAPES, allowlist

PLACES = r"structure\.json|programs/v0/|node '|the module at|manifest|holds |export "


def _insert(*nodes: dict[str, Any]) -> Change:
    """Put ``nodes`` into a program just before its output node (the graph runs them)."""
    def change(program: dict, marker: str) -> None:
        program["nodes"][-1:-1] = json.loads(json.dumps(list(nodes)).replace("MARKER", marker))
    return change


def _fn(name: str, target: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    return {"name": name, "op": "call_function", "target": target, "args": list(args),
            "kwargs": kwargs}


def _method(name: str, target: str, *args: Any) -> dict[str, Any]:
    return {"name": name, "op": "call_method", "target": target, "args": list(args),
            "kwargs": {}}


def _getattr_node(name: str, target: str) -> dict[str, Any]:
    return {"name": name, "op": "get_attr", "target": target, "args": [], "kwargs": {}}


def _ref(name: str) -> dict[str, str]:
    return {"__node__": name}


Case = tuple[str, Change, str]
CASES: dict[str, Case] = {}

# -- 1. code execution --------------------------------------------------------------------------

for _name in sorted(ESCAPES):
    CASES[f"escape_call_{_name}"] = (SEGMENT, _insert(_fn("evil", f"torch.Tensor.{_name}", X)),
                                     "may never call")
    CASES[f"escape_method_{_name}"] = (SEGMENT, _insert(_method("evil", _name, X)),
                                       "calls the method")
for _name in ("view", "add", "contiguous", "size"):  # even an ordinary method: receiver unknown
    CASES[f"plain_method_{_name}"] = (SEGMENT, _insert(_method("evil", _name, X)),
                                      "calls the method")
CASES["payload_storage_type"] = (SEGMENT, _insert(
    _fn("storage", "torch.Tensor.untyped_storage", X),
    _fn("evil", "torch.Tensor.type", _ref("storage"), "evil_payload.run")), "may never call")
CASES["payload_storage_type_methods"] = (SEGMENT, _insert(
    _method("storage", "untyped_storage", X),
    _method("evil", "type", _ref("storage"), "evil_payload.run")), "calls the method")
for _target in ("builtins.eval", "builtins.exec", "builtins.compile", "builtins.__import__",
                "importlib.import_module", "os.system", "subprocess.run", "runpy.run_path",
                "torch._utils._import_dotted_name", "torch.load", "torch.save", "pickle.loads",
                "torch.hub.load", "torch.jit.load", "ctypes.CDLL", "torch.ops.load_library",
                "torch.utils.cpp_extension.load_inline", "fxckpt.load", "sys.exit"):
    CASES[f"runs_{_target}"] = (ROOT, call(_target, "MARKER"), "not on fxckpt's allowlist")

# -- 2. memory-unsafe operators -----------------------------------------------------------------

AUDIT_CRASHES = [
    "_reshape_alias.default", "_reshape_alias_copy.default",
    "max_pool2d_with_indices_backward.default", "max_pool3d_with_indices_backward.default",
    "adaptive_max_pool2d_backward.default", "adaptive_max_pool3d_backward.default",
    "_sobol_engine_draw.default", "_sobol_engine_ff_.default", "_sobol_engine_scramble_.default",
    "_embedding_bag_dense_backward.default", "_segment_reduce_backward.default",
    "_ctc_loss.default", "_ctc_loss_backward.default",
]
"""The operators the audit crashed the process with (SIGSEGV, and one hang)."""


def _off_list_operators() -> list[str]:
    """Every ``*_backward`` and private raw-geometry ATen overload of this torch, a sample."""
    from fxckpt.export.allowlist import refusal

    found = []
    for name in sorted(torch._C._dispatch_get_all_op_names()):
        if not name.startswith("aten::"):
            continue
        op, _, overload = name[len("aten::"):].partition(".")
        qualified = f"torch.ops.aten.{op}.{overload or 'default'}"
        if refusal("functions", qualified) is not None:
            found.append(qualified)
    return found[::max(1, len(found) // 60)]


for _op in AUDIT_CRASHES:
    _target = f"torch.ops.aten.{_op}"
    CASES[f"audit_{_op}"] = (SEGMENT, _insert(_fn("evil", _target, X, [1 << 20], [1 << 10])),
                             "torch.ops.aten." + _op.partition(".")[0])
for _target in _off_list_operators():
    CASES[f"refused_{_target.removeprefix('torch.ops.aten.')}"] = (
        SEGMENT, _insert(_fn("evil", _target, X, [1 << 20], [1 << 10])), "may never call")

# -- 3. storage resized or swapped through a method ----------------------------------------------

for _name, _args in (("resize_", [[1 << 24]]), ("resize_as_", [X]), ("set_", [X]),
                     ("as_strided", [[1 << 20], [1]]), ("as_strided_", [[1 << 20], [1]])):
    CASES[f"storage_{_name}"] = (SEGMENT, _insert(_fn("evil", f"torch.Tensor.{_name}", X,
                                                      *_args)), "may never call")

# -- 4. containers as leaves, modules where the runtime does not take them ------------------------

for _cls in ("ParameterDict", "ModuleDict", "ModuleList", "Sequential", "ParameterList",
             "Container"):
    CASES[f"container_leaf_{_cls}"] = (STRUCTURE, leaf(cls=f"torch.nn.modules.container:{_cls}"),
                                       "containers never are")
_SEG = _ref("segment_0")
for _target, _args in (("operator.setitem", [_SEG, "forward", X]),
                       ("operator.getitem", [_SEG, "forward"]),
                       ("operator.delitem", [_SEG, "forward"]),
                       ("torch.utils._pytree.tree_leaves", [_SEG]),
                       ("builtins.getattr", [_SEG, "shape"]),
                       ("torch.ops.aten.add.Tensor", [_SEG, X]),
                       ("fxckpt.checkpoint", [X, _SEG]),
                       ("torch.ops.higher_order.wrap_with_set_grad_enabled", [_SEG, _SEG, X])):
    CASES[f"module_to_{_target}"] = (ROOT, _insert(_fn("evil", _target, *_args)),
                                     "passes the module")
ALLOWED = [c.removeprefix("module_to_") for c in CASES if c.startswith("module_to_")]
"""Loaded with these allowed, so that the rule on modules is what refuses those cases."""

# -- 6. the smaller ones -------------------------------------------------------------------------

for _slot in ("_call_impl", "forward", "_apply", "register_forward_hook", "state_dict",
              "__call__", "T_destination", "extra_repr"):
    CASES[f"tensor_slot_{_slot}"] = (STRUCTURE, leaf(params={_slot: "head.weight"}),
                                     "is not a tensor name an export may use")


@pytest.mark.parametrize("case", list(CASES))
def test_each_crafted_export_is_refused_naming_its_place(forge: Any, case: str) -> None:
    rel, change, message = CASES[case]
    forge.edit(rel, lambda data: change(data, str(forge.marker)))
    start = time.perf_counter()
    with pytest.raises(ExportError) as e:
        fxckpt.load(forge.root, allow=ALLOWED)
    assert time.perf_counter() - start < 10
    assert message in str(e.value), str(e.value)
    assert re.search(PLACES, str(e.value)), str(e.value)


def test_the_corpus_covers_every_class_with_two_hundred_exports() -> None:
    """With the cases of test_forged.py and the files and memory cases below, 200 and more."""
    assert len(CASES) >= 150, len(CASES)
    assert {c.split("_")[0] for c in CASES} >= {"escape", "runs", "audit", "refused", "storage",
                                                 "container", "module", "tensor"}


# -- 1. files the manifest does not list ------------------------------------------------------

PAYLOAD = "import pathlib\npathlib.Path({marker!r}).write_text('ran')\n"


@pytest.mark.parametrize("rel", ["payload.py", "programs/payload.py", "__init__.py",
                                 "sitecustomize.py", "evil.pth", "programs/v0/extra.json",
                                 "deep/er/payload.py"])
def test_a_file_the_manifest_does_not_list_is_refused(forge: Any, rel: str) -> None:
    path = forge.root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(PAYLOAD.format(marker=str(forge.marker)))
    with pytest.raises(ExportError, match=f"holds {re.escape(rel)}, which its manifest does not"):
        fxckpt.load(forge.root)
    sys.path_importer_cache.clear()
    assert str(forge.root) not in sys.path


def test_a_symlink_the_manifest_does_not_list_is_refused(forge: Any) -> None:
    os.symlink("/etc", forge.root / "linked")
    with pytest.raises(ExportError, match="holds linked, which its manifest does not list"):
        fxckpt.load(forge.root)


# -- 5. memory without bound ----------------------------------------------------------------------

def _bombs() -> list[tuple[str, list[dict[str, Any]]]]:
    """Allowlisted operators asked for 2 GiB or more (only those on this list)."""
    big, huge = [1 << 29], [1 << 16, 1 << 15]
    candidates = [
        ("new_ones", [_fn("evil", "torch.ops.aten.new_ones.default", X, big)]),
        ("new_zeros", [_fn("evil", "torch.ops.aten.new_zeros.default", X, big)]),
        ("new_empty", [_fn("evil", "torch.ops.aten.new_empty.default", X, big)]),
        ("ones", [_fn("evil", "torch.ops.aten.ones.default", big)]),
        ("zeros", [_fn("evil", "torch.ops.aten.zeros.default", big)]),
        ("full", [_fn("evil", "torch.ops.aten.full.default", big, 1.0)]),
        ("empty", [_fn("evil", "torch.ops.aten.empty.memory_format", big)]),
        ("arange", [_fn("evil", "torch.ops.aten.arange.default", 1 << 29)]),
        ("expand_contiguous", [_fn("wide", "torch.ops.aten.expand.default", X, [1 << 20, 4, 32]),
                               _fn("evil", "torch.ops.aten.contiguous.default", _ref("wide"))]),
        ("expand_clone", [_fn("wide", "torch.ops.aten.expand.default", X, [1 << 20, 4, 32]),
                          _fn("evil", "torch.ops.aten.clone.default", _ref("wide"))]),
        ("repeat", [_fn("evil", "torch.ops.aten.repeat.default", X, [1 << 14, 1 << 4])]),
        ("outer", [_fn("col", "torch.ops.aten.view.default", X, [-1, 1]),
                   _fn("wide", "torch.ops.aten.expand.default", _ref("col"), [128, 1 << 22]),
                   _fn("evil", "torch.ops.aten.mul.Tensor", _ref("wide"), _ref("wide"))]),
        ("zeros_like_expand", [_fn("wide", "torch.ops.aten.expand.default", X, huge + [4]),
                               _fn("evil", "torch.ops.aten.zeros_like.default", _ref("wide"))]),
    ]
    listed = allowlist().functions
    return [(n, nodes) for n, nodes in candidates if all(d["target"] in listed for d in nodes)]


BOMB_LOADS = '''
import resource, sys, time
sys.path.insert(0, {tests!r})
import fxckpt
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
results = []
for path in {paths!r}:
    start = time.perf_counter()
    try:
        fxckpt.load(path)
        results.append(["loaded", time.perf_counter() - start, ""])
    except fxckpt.ExportError as e:
        results.append(["refused", time.perf_counter() - start, str(e)])
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(__import__("json").dumps([results, grown]))
'''


def test_graphs_that_would_allocate_gigabytes_are_refused_before_they_do(forge: Any,
                                                                           tmp_path: Path) -> None:
    bombs = _bombs()
    assert len(bombs) >= 5, [n for n, _ in bombs]
    paths = []
    for name, nodes in bombs:
        target = tmp_path / name
        with forge.copy(target):
            forge.edit(SEGMENT, lambda data, n=nodes: _insert(*n)(data, ""))
        paths.append(str(target))
    tests = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", BOMB_LOADS.format(tests=tests, paths=paths)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    results, grown_kib = json.loads(out.stdout.strip().splitlines()[-1])
    for (name, _), (outcome, seconds, message) in zip(bombs, results):
        assert outcome == "refused", name
        assert "allocates" in message and "programs/v0/root.json" in message, message
        assert seconds < 10, (name, seconds)
    assert grown_kib < 256 << 10, f"loading the bombs grew resident memory by {grown_kib} KiB"


@pytest.mark.parametrize("rel", [STRUCTURE, ROOT, SEGMENT, "graphs/v0.json"])
def test_a_json_file_over_its_cap_is_refused_before_it_is_read(forge: Any, rel: str) -> None:
    forge.edit(rel, lambda data: json.dumps(data) + " " * (2 << 20))
    with pytest.raises(ExportError, match=rf"{re.escape(rel)} is \d+ bytes, over the 1048576"):
        fxckpt.load(forge.root, max_json_bytes=1 << 20)


def test_the_default_json_cap_holds_without_reading_the_file(forge: Any) -> None:
    from fxckpt.export.files import MAX_JSON_BYTES

    path = forge.root / STRUCTURE
    with open(path, "r+b") as f:  # a sparse file past the cap: its size, not its bytes
        f.truncate(MAX_JSON_BYTES + 1)
    with pytest.raises(ExportError, match="over the 67108864 bytes a JSON file"):
        fxckpt.load(forge.root)


def test_deeply_nested_json_is_refused(forge: Any) -> None:
    forge.edit(ROOT, lambda data: "[" * 100_000 + "]" * 100_000)
    with pytest.raises(ExportError, match="programs/v0/root.json"):
        fxckpt.load(forge.root)


# -- 6. an LSTM's list of its parameters ----------------------------------------------------------

class _Recurrent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.LSTM(8, 8, batch_first=True)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


@pytest.mark.parametrize("names", [["__class__"], ["weight_ih_l0", "_call_impl"], "weight_ih_l0",
                                   [1], ["missing"]])
def test_an_lstm_whose_weight_names_are_forged_is_refused(tmp_path: Path, names: Any) -> None:
    tm = fxckpt.transform(_Recurrent(), every=1, example_inputs=(torch.randn(2, 5, 8),))
    fxckpt.save(tm, tmp_path / "lstm")
    fxckpt.load(tmp_path / "lstm")  # as saved: loads
    structure = json.loads((tmp_path / "lstm" / STRUCTURE).read_text())
    rnn = next(e for e in structure["variants"][0]["modules"]
               if e.get("cls", "").endswith(":LSTM"))
    rnn["attrs"]["_flat_weights_names"] = names
    rehash(tmp_path / "lstm", STRUCTURE, json.dumps(structure).encode())
    with pytest.raises(ExportError, match="_flat_weights_names must name its own parameters"):
        fxckpt.load(tmp_path / "lstm")
