"""fxckpt.save / fxckpt.load: round trips without the model's code, integrity checks, atomicity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fxckpt
from fxckpt.export import ExportError, LoadedModule
from models import MLP, ResNet, gpt2
from support import assert_steps_equal, run_step

REPO = Path(__file__).resolve().parents[1]

USER_MODEL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    """A user's model: its class lives only in this file."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Dropout(0.2))
                                    for _ in range(4))
        self.out = nn.Linear(32, 3)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        h = F.gelu(self.inp(x))
        for block in self.blocks:
            h = h + torch.tanh(block(h)) * self.scale
        return {"logits": self.out(h), "hidden": h}
'''

CHILD = '''
import importlib.util, sys, torch
import fxckpt
torch.set_num_threads({threads})  # as the parent computed the expected values: results depend on it
sys.path.insert(0, {tests!r})
from support import run_step
assert importlib.util.find_spec({module!r}) is None, "the model's module must not be importable here"
for name in {names!r}:
    expected = torch.load({root!r} + "/" + name + ".expected.pt", weights_only=True)
    loaded = fxckpt.load({root!r} + "/" + name)
    step = run_step(loaded, tuple(expected["args"]), {{}}, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(step.out, expected["out"])), name + ": outputs differ"
    assert step.param_grads.keys() == expected["grads"].keys(), name + ": parameter names differ"
    for k, g in expected["grads"].items():
        assert torch.equal(step.param_grads[k], g), name + ": grad of " + k + " differs"
    for k, b in expected["buffers"].items():
        assert torch.equal(step.buffers[k], b), name + ": buffer " + k + " differs"
    print(name, "ok", len(expected["grads"]), "grads", type(loaded(*expected["args"])).__name__)
'''


def _expected(tm: torch.nn.Module, args: tuple) -> dict:
    step = run_step(tm, args, {}, seed=0)
    return {"args": list(args), "out": step.out, "grads": step.param_grads, "buffers": step.buffers}


def test_round_trip_in_a_fresh_process_without_the_model_code(tmp_path: Path) -> None:
    module = f"user_net_{os.getpid()}"
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / f"{module}.py").write_text(USER_MODEL)
    sys.path.insert(0, str(tmp_path / "src"))
    try:
        net = __import__(module).Net().train()
    finally:
        sys.path.remove(str(tmp_path / "src"))
        sys.modules.pop(module, None)
    cases = {"user": (net, dict(every=2), (torch.randn(8, 16),)),
             "gpt2": (gpt2(), dict(depth=3), (torch.randint(0, 64, (2, 12)),))}
    for name, (model, options, args) in cases.items():
        tm = fxckpt.transform(model, **options, example_inputs=args)
        fxckpt.save(tm, tmp_path / name)  # before the step: the export holds the weights the step starts from
        torch.save(_expected(tm, args), tmp_path / f"{name}.expected.pt")
    script = CHILD.format(tests=str(REPO / "tests"), module=module, names=list(cases), root=str(tmp_path),
                          threads=torch.get_num_threads())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    (tmp_path / "run").mkdir()
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path / "run", env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "user ok" in proc.stdout and "dict" in proc.stdout
    assert "gpt2 ok" in proc.stdout and "CausalLMOutput" in proc.stdout


def test_loaded_module_keeps_names_ties_plan_and_trains_like_the_original(tmp_path: Path) -> None:
    model = gpt2()
    ids = torch.randint(0, 64, (2, 12))
    tm = fxckpt.transform(model, depth=3, example_inputs=(ids,))
    fxckpt.save(tm, tmp_path / "g")
    loaded = fxckpt.load(tmp_path / "g")
    assert isinstance(loaded, LoadedModule)
    assert list(loaded.state_dict()) == list(tm.state_dict())
    assert loaded.transformer.wte.weight is loaded.lm_head.weight  # tied weights stay tied
    assert loaded.plan == fxckpt.inspect(tm).plan and "fxckpt_checkpoint(segment_0" in loaded.code
    assert_steps_equal(run_step(tm, (ids,), {}), run_step(loaded, (ids,), {}))
    assert json.loads((tmp_path / "g" / "plan.json").read_text())["strategy"] == "depth"
    with pytest.raises(ExportError, match="holds graphs for train"):
        loaded(torch.randint(0, 64, (3, 12)))  # export graphs are specialised to their shapes


def test_symbolic_graphs_serve_other_batch_sizes_and_both_modes(tmp_path: Path) -> None:
    model = ResNet()
    x = torch.randn(2, 3, 8, 8)
    tm = fxckpt.transform(model, every=2, example_inputs=(x,))
    fxckpt.save(tm, tmp_path / "r", example_inputs=(x,))  # plans eval() too
    loaded = fxckpt.load(tmp_path / "r")
    assert sorted(v.training for v in loaded.variants) == [False, True]
    bigger = torch.randn(4, 3, 8, 8)
    assert_steps_equal(run_step(tm, (bigger,), {}), run_step(loaded, (bigger,), {}))
    tm.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(tm(x), loaded(x))


def test_staged_module_round_trip_rebuilds_the_pipeline(tmp_path: Path) -> None:
    x = torch.randn(4, 3, 8, 8)
    tm = fxckpt.transform(ResNet(), every=2, chunks=2, devices=["cpu", "cpu"], example_inputs=(x,))
    fxckpt.save(tm, tmp_path / "s")
    loaded = fxckpt.load(tmp_path / "s")
    assert loaded.plan.pipeline is not None and loaded.plan.pipeline["chunks"] == 2
    # same micro-batches, schedule, recompute and deferred BatchNorm statistics: bit-identical
    assert_steps_equal(run_step(tm, (x,), {}), run_step(loaded, (x,), {}))
    assert loaded.pipeline.recomputed == fxckpt.inspect(tm).pipeline.recomputed == [(0, 1), (0, 0)]


@pytest.mark.parametrize("victim", ["weights.safetensors", "code/v0/segment_0.py", "structure.json"])
def test_a_flipped_byte_is_refused_with_a_hash_mismatch(tmp_path: Path, victim: str) -> None:
    x = torch.randn(8, 32)
    fxckpt.save(fxckpt.transform(MLP(), every=2, example_inputs=(x,)), tmp_path / "m")
    path = tmp_path / "m" / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ExportError, match=f"{victim}.*hash mismatch"):
        fxckpt.load(tmp_path / "m")


def test_edited_manifest_and_missing_files_are_refused(tmp_path: Path) -> None:
    fxckpt.save(fxckpt.transform(MLP(), every=2, example_inputs=(torch.randn(8, 32),)), tmp_path / "m")
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    manifest["files"]["code/v0/root.py"] = "0" * 64
    (tmp_path / "m" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match="root.py.*hash mismatch"):
        fxckpt.load(tmp_path / "m")
    with pytest.raises(ExportError, match="no fxckpt export"):
        fxckpt.load(tmp_path / "nothing")


def test_code_may_only_import_from_allowed_packages_even_with_a_consistent_manifest(tmp_path: Path) -> None:
    from fxckpt.export.files import content_hash, sha256_bytes

    fxckpt.save(fxckpt.transform(MLP(), every=2, example_inputs=(torch.randn(8, 32),)), tmp_path / "m")
    structure_path, manifest_path = tmp_path / "m" / "structure.json", tmp_path / "m" / "manifest.json"
    structure = json.loads(structure_path.read_text())
    structure["variants"][0]["modules"][0]["globals"]["torch"] = {"module": "os"}  # a forger's edit...
    structure_path.write_text(json.dumps(structure))
    manifest = json.loads(manifest_path.read_text())  # ...with the hashes recomputed to match
    manifest["files"]["structure.json"] = sha256_bytes(structure_path.read_bytes())
    manifest["content_hash"] = content_hash(manifest["files"])
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match="'os', which is not one of"):
        fxckpt.load(tmp_path / "m")


def test_a_failed_save_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fxckpt.export.files as files

    tm = fxckpt.transform(MLP(), every=2, example_inputs=(torch.randn(8, 32),))

    def broken(tensors: dict) -> tuple:
        raise OSError("disk full")

    monkeypatch.setattr(files, "_weights_bytes", broken)
    with pytest.raises(OSError, match="disk full"):
        fxckpt.save(tm, tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


CRASH = '''
import os, sys, torch
sys.path.insert(0, {tests!r})
import fxckpt, fxckpt.export.files as files
from models import MLP
tm = fxckpt.transform(MLP(), every=2, example_inputs=(torch.randn(8, 32),))
real, written = files._write, []
def write_then_die(root, rel, data):
    written.append(rel)
    if len(written) == 3:
        os._exit(17)  # the process dies mid-save: no cleanup, no exception handler runs
    return real(root, rel, data)
files._write = write_then_die
fxckpt.save(tm, {target!r})
'''


def test_a_save_killed_midway_leaves_no_loadable_directory(tmp_path: Path) -> None:
    target = tmp_path / "m"
    script = CRASH.format(tests=str(REPO / "tests"), target=str(target))
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 17, proc.stderr[-2000:]
    assert not target.exists()
    leftovers = list(tmp_path.iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".m.tmp-")
    with pytest.raises(ExportError, match="manifest.json is missing"):
        fxckpt.load(leftovers[0])


def test_save_replaces_an_export_but_never_another_directory(tmp_path: Path) -> None:
    x = torch.randn(8, 32)
    fxckpt.save(fxckpt.transform(MLP(), every=2, example_inputs=(x,)), tmp_path / "m")
    fxckpt.save(fxckpt.transform(MLP(), every=3, example_inputs=(x,)), tmp_path / "m")
    assert fxckpt.load(tmp_path / "m").plan.options["every"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    with pytest.raises(ExportError, match="not an fxckpt export"):
        fxckpt.save(fxckpt.transform(MLP(), every=2, example_inputs=(x,)), tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "precious"


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


torch.fx.wrap("_double")


class CallsUserFunction(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(_double(self.fc(x)))


def test_save_refuses_graphs_that_call_the_users_own_code(tmp_path: Path) -> None:
    tm = fxckpt.transform(CallsUserFunction(), every=1, example_inputs=(torch.randn(2, 4),))
    with pytest.raises(ExportError, match="_double.*not one of"):
        fxckpt.save(tm, tmp_path / "u")
    assert not (tmp_path / "u").exists()
    unplanned = fxckpt.transform(MLP(), every=2)
    with pytest.raises(ExportError, match="has not planned yet"):
        fxckpt.save(unplanned, tmp_path / "u")


def test_generated_code_is_readable_in_the_export(tmp_path: Path) -> None:
    fxckpt.save(fxckpt.transform(MLP(), every=2, example_inputs=(torch.randn(8, 32),)), tmp_path / "m")
    root = (tmp_path / "m" / "code" / "v0" / "root.py").read_text()
    assert "fxckpt_checkpoint(segment_0, x)" in root
    assert textwrap.dedent(root).count("def forward") == 1


class Recurrent(torch.nn.Module):
    """Leaf modules whose state is more than weights: an LSTM (flat weight lists), attention, embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.inp = torch.nn.Linear(8, 16)
        self.rnn = torch.nn.LSTM(16, 16, batch_first=True)
        self.att = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(torch.relu(self.inp(self.emb(ids))))
        a, _ = self.att(h, h, h)
        return self.out(torch.tanh(a + h))


def test_torch_leaf_modules_are_rebuilt_without_their_constructors(tmp_path: Path) -> None:
    ids = torch.randint(0, 10, (2, 5))
    tm = fxckpt.transform(Recurrent(), every=1, example_inputs=(ids,))
    fxckpt.save(tm, tmp_path / "r")
    loaded = fxckpt.load(tmp_path / "r")
    assert type(loaded.graph_module.rnn) is torch.nn.LSTM
    assert_steps_equal(run_step(tm, (ids,), {}), run_step(loaded, (ids,), {}))
