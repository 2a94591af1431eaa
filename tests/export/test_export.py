"""fxckpt.save / fxckpt.load: round trips without the model's code, integrity checks, atomicity."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fxckpt
from fxckpt.export import ExportError, LoadedModule
from models import MLP, ResNet, gpt2
from support import assert_steps_equal, run_step

REPO = Path(__file__).resolve().parents[2]

USER_MODEL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    """A user's model: its class lives only in this file."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Dropout(0.2))
            for _ in range(4)
        )
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
# as the parent computed the expected values: results depend on it
torch.set_num_threads({threads})
sys.path.insert(0, {tests!r})
from support import run_step
assert importlib.util.find_spec({module!r}) is None, (
    "the model's module must not be importable here"
)
for name in {names!r}:
    expected = torch.load({root!r} + "/" + name + ".expected.pt", weights_only=True)
    loaded = fxckpt.load({root!r} + "/" + name)
    step = run_step(loaded, tuple(expected["args"]), {{}}, seed=0)
    assert all(
        torch.equal(a, b) for a, b in zip(step.out, expected["out"])
    ), name + ": outputs differ"
    assert step.param_grads.keys() == expected["grads"].keys(), name + ": parameter names differ"
    for k, g in expected["grads"].items():
        assert torch.equal(step.param_grads[k], g), name + ": grad of " + k + " differs"
    for k, b in expected["buffers"].items():
        assert torch.equal(step.buffers[k], b), name + ": buffer " + k + " differs"
    print(name, "ok", len(expected["grads"]), "grads", type(loaded(*expected["args"])).__name__)
'''


def _expected(tm: torch.nn.Module, args: tuple) -> dict:
    step = run_step(tm, args, {}, seed=0)
    return {
        "args": list(args),
        "out": step.out,
        "grads": step.param_grads,
        "buffers": step.buffers,
    }


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
        fxckpt.save(
            tm, tmp_path / name
        )  # before the step: the export holds the weights the step starts from
        torch.save(_expected(tm, args), tmp_path / f"{name}.expected.pt")
    script = CHILD.format(
        tests=str(REPO / "tests"),
        module=module,
        names=list(cases),
        root=str(tmp_path),
        threads=torch.get_num_threads(),
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    (tmp_path / "run").mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path / "run",
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
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


def test_a_module_trained_through_dynamo_saves_a_whole_graph_given_inputs(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MLP()
    reference, fresh = copy.deepcopy(model), copy.deepcopy(model)
    x = torch.randn(4, 32)
    tm = fxckpt.transform(model, every=2)  # the default: training calls through Dynamo
    assert_steps_equal(run_step(tm, (x,), {}), run_step(reference, (x,), {}))
    assert fxckpt.inspect(tm).plan.capture == "dynamo"
    with pytest.raises(ExportError, match="trains through Dynamo .* pass example_inputs= to "
                                          "fxckpt.save"):
        fxckpt.save(tm, tmp_path / "m")
    fxckpt.save(tm, tmp_path / "m", example_inputs=(x,))
    loaded = fxckpt.load(tmp_path / "m")
    assert loaded.plan.capture == "symbolic_trace" and loaded.plan.segments
    assert_steps_equal(run_step(loaded, (x,), {}, seed=1), run_step(fresh, (x,), {}, seed=1))
    assert_steps_equal(run_step(tm, (x,), {}, seed=2), run_step(reference, (x,), {}, seed=2))
    assert fxckpt.inspect(tm).plan.capture == "dynamo"  # training stays on Dynamo


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
    assert loaded.plan.pipeline is not None and loaded.plan.pipeline.chunks == 2
    assert loaded.plan == fxckpt.inspect(tm).plan  # the typed pipeline view round-trips
    # same micro-batches, schedule, recompute and deferred BatchNorm statistics: bit-identical
    assert_steps_equal(run_step(tm, (x,), {}), run_step(loaded, (x,), {}))
    assert loaded.pipeline.recomputed == fxckpt.inspect(tm).pipeline.recomputed == [(0, 1), (0, 0)]


@pytest.mark.parametrize("victim", ["weights.safetensors", "programs/v0/segment_0.json",
                                    "structure.json"])
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
    fxckpt.save(
        fxckpt.transform(MLP(), every=2, example_inputs=(torch.randn(8, 32),)), tmp_path / "m"
    )
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    manifest["files"]["programs/v0/root.json"] = "0" * 64
    (tmp_path / "m" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match="root.json.*hash mismatch"):
        fxckpt.load(tmp_path / "m")
    with pytest.raises(ExportError, match="no fxckpt export"):
        fxckpt.load(tmp_path / "nothing")


def test_a_failed_save_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fxckpt.export.files as files

    tm = fxckpt.transform(MLP(), every=2, example_inputs=(torch.randn(8, 32),))

    def broken(tensors: dict) -> tuple:
        raise OSError("disk full")

    monkeypatch.setattr(files, "weights_bytes", broken)
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
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
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
    from patterns import QuantizedNet

    tm = fxckpt.transform(CallsUserFunction(), every=1, example_inputs=(torch.randn(2, 4),))
    with pytest.raises(ExportError, match=r"node '_double' .* calls test_export\._double, which "
                                          r"is not one of the functions a loaded export may call"):
        fxckpt.save(tm, tmp_path / "u")
    function = fxckpt.transform(QuantizedNet(), every=1, example_inputs=(torch.randn(4, 16),))
    with pytest.raises(ExportError, match=r"node 'round_ste_apply' .* calls the custom autograd "
                                          r"Function patterns\.RoundSTE"):
        fxckpt.save(function, tmp_path / "u")
    assert not (tmp_path / "u").exists()
    unplanned = fxckpt.transform(MLP(), every=2)
    with pytest.raises(ExportError, match="has not planned yet"):
        fxckpt.save(unplanned, tmp_path / "u")


def _graph_modules(root: torch.nn.Module) -> dict[str, torch.fx.GraphModule]:
    return {n: m for n, m in root.named_modules() if isinstance(m, torch.fx.GraphModule)}


def _code_without_annotations(gm: torch.fx.GraphModule) -> str:
    graph = copy.deepcopy(gm.graph)
    for n in graph.nodes:
        n.type = None
    return graph.python_code(root_module="self").src


def test_graphs_are_saved_as_data_and_load_generates_the_same_code(tmp_path: Path) -> None:
    from fxckpt.module import dispatcher_of

    tm = fxckpt.transform(MLP(), every=2, example_inputs=(torch.randn(8, 32),))
    fxckpt.save(tm, tmp_path / "m")
    assert not list((tmp_path / "m").rglob("*.py"))
    root = json.loads((tmp_path / "m" / "programs" / "v0" / "root.json").read_text())
    calls = [n for n in root["nodes"] if n["op"] == "call_function"]
    assert calls[0]["target"] == "fxckpt.checkpoint"
    assert calls[0]["args"][0] == {"__node__": "segment_0"}
    loaded = fxckpt.load(tmp_path / "m")
    original = _graph_modules(dispatcher_of(tm).last.gm)
    rebuilt = _graph_modules(loaded.graph_module)
    assert sorted(rebuilt) == sorted(original) == ["", "segment_0", "segment_1", "segment_2"]
    for name, gm in original.items():
        assert rebuilt[name].code == _code_without_annotations(gm), name
    assert "fxckpt_checkpoint(segment_0, x)" in loaded.code


def test_transformer_encoder_layers_save_their_activation_by_name(tmp_path: Path) -> None:
    from patterns import Encoder

    x = torch.randn(2, 6, 16)
    model = Encoder(depth=2)
    model.layers.eval()  # traced through in training (passes.nn_modules); leaves in eval
    for m in model.modules():  # a loaded module trains every module: no dropout to differ
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(m, torch.nn.MultiheadAttention):
            m.dropout = 0.0
    tm = fxckpt.transform(model, depth=2, example_inputs=(x,))
    fxckpt.save(tm, tmp_path / "e")
    structure = json.loads((tmp_path / "e" / "structure.json").read_text())
    attrs = [e["attrs"] for e in structure["variants"][0]["modules"]
             if e.get("cls") == "torch.nn.modules.transformer:TransformerEncoderLayer"]
    relu = {"__function__": "torch.nn.functional.relu"}
    assert attrs and all(a["activation"] == relu for a in attrs)
    loaded = fxckpt.load(tmp_path / "e")
    layers = [m for m in loaded.graph_module.modules()
              if isinstance(m, torch.nn.TransformerEncoderLayer)]
    assert len(layers) == 2 and all(m.activation is torch.nn.functional.relu for m in layers)
    assert_steps_equal(run_step(tm, (x,), {}), run_step(loaded, (x,), {}))


def test_save_refuses_leaf_modules_with_hooks(tmp_path: Path) -> None:
    model = MLP()
    model.layers[0].fc.register_forward_hook(lambda m, i, o: o * 2)
    tm = fxckpt.transform(model, every=2, example_inputs=(torch.randn(8, 32),))
    with pytest.raises(ExportError, match=r"the module at layers\.0\.fc \(Linear\) has hooks"):
        fxckpt.save(tm, tmp_path / "h")


def test_export_graphs_with_swapped_modules_round_trip_once_their_hooks_are_removed(
        tmp_path: Path) -> None:
    """A hooked leaf is kept as a module in a torch.export graph, called through pytree specs
    (``_spec_N`` attributes); the hook itself cannot be saved, the structure can."""
    from patterns import ExportOnly

    model = ExportOnly(MLP(depth=2), width=32)
    hook = model.inner.layers[0].fc.register_forward_hook(lambda m, i, o: None)
    x = torch.randn(4, 32)
    tm = fxckpt.transform(model, every=1, example_inputs=(x,))
    with pytest.raises(ExportError, match=r"inner\.layers\.0\.fc \(Linear\) has hooks"):
        fxckpt.save(tm, tmp_path / "s")
    hook.remove()
    fxckpt.save(tm, tmp_path / "s")
    loaded = fxckpt.load(tmp_path / "s")
    assert loaded.variants[0].capture == "export"
    assert {"_spec_0", "_spec_1"} <= set(vars(loaded.graph_module))
    assert_steps_equal(run_step(tm, (x,), {}), run_step(loaded, (x,), {}))


class Recurrent(torch.nn.Module):
    """Leaf modules whose state is more than weights: an LSTM (flat weight lists), attention,
    embedding."""

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


SEGMENT = "programs/v0/segment_0.json"


def _swap_in(root: Path, rel: str, old: str, new: str) -> None:
    """Replace ``old`` by ``new`` in a file and recompute its hashes (no key needed for that)."""
    from fxckpt.export.files import content_hash, sha256_bytes

    (root / rel).write_text((root / rel).read_text().replace(old, new))
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"][rel] = sha256_bytes((root / rel).read_bytes())
    manifest["content_hash"] = content_hash(manifest["files"])
    (root / "manifest.json").write_text(json.dumps(manifest))


def test_a_keyed_export_refuses_any_change_and_needs_its_key(tmp_path: Path) -> None:
    x = torch.randn(8, 32)
    tm = fxckpt.transform(MLP(), every=2, example_inputs=(x,))
    fxckpt.save(tm, tmp_path / "k", key="s3cret")
    fxckpt.save(tm, tmp_path / "plain")
    loaded = fxckpt.load(tmp_path / "k", key=b"s3cret")  # str keys are their UTF-8 bytes
    assert_steps_equal(run_step(tm, (x,), {}), run_step(loaded, (x,), {}))
    with pytest.raises(ExportError, match="was saved with a key .* pass the same key="):
        fxckpt.load(tmp_path / "k")
    with pytest.raises(ExportError, match="MAC mismatch"):
        fxckpt.load(tmp_path / "k", key="guess")
    with pytest.raises(ExportError, match="has no MAC, but key= was given"):
        fxckpt.load(tmp_path / "plain", key="s3cret")
    for name in ("k", "plain"):  # a valid table name swapped in: data, but not the saved graph
        _swap_in(tmp_path / name, SEGMENT, "torch.nn.functional.gelu", "torch.relu")
    swapped = fxckpt.load(tmp_path / "plain")  # without a key, hashes only catch corruption
    assert "torch.relu(" in swapped.graph_module.segment_0.code
    with pytest.raises(ExportError, match="MAC mismatch"):
        fxckpt.load(tmp_path / "k", key="s3cret")
    manifest = json.loads((tmp_path / "k" / "manifest.json").read_text())
    del manifest["mac"]
    (tmp_path / "k" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match="has no MAC, but key= was given"):
        fxckpt.load(tmp_path / "k", key="s3cret")
    with pytest.raises(ExportError, match="key must be a non-empty str or bytes"):
        fxckpt.save(tm, tmp_path / "bad", key=b"")


def test_loaded_segments_are_segments_with_the_saved_name_and_restores(tmp_path: Path) -> None:
    from fxckpt.runtime.segment import segment_of

    x = torch.randn(2, 3, 16, 16)
    tm = fxckpt.transform(ResNet(), depth=2, example_inputs=(x,))
    fxckpt.save(tm, tmp_path / "r")
    structure = json.loads((tmp_path / "r" / "structure.json").read_text())
    modules = structure["variants"][0]["modules"]
    saved = {e["path"]: e["segment"] for e in modules if "segment" in e}
    plan = fxckpt.inspect(tm).plan
    # a ResNet draws no random numbers: no segment saves torch's generator state
    assert saved == {s.name: {"name": s.name, "restores": list(s.restores), "draws": False}
                     for s in plan.segments}
    loaded = fxckpt.load(tmp_path / "r")
    for s in plan.segments:
        seg = segment_of(loaded.graph_module, s.name)
        assert (seg.name, seg.restores, seg.offloader) == (s.name, s.restores, None)
    assert any("running_mean" in name for s in plan.segments for name in s.restores)


def test_a_segment_without_early_stop_saves_and_loads_so(tmp_path) -> None:
    """RReLU in a segment turns torch's early stop off there; the loaded export keeps it off."""
    nn = torch.nn
    model = nn.Sequential(nn.Linear(8, 8), nn.RReLU(), nn.Linear(8, 8), nn.GELU(),
                          nn.Linear(8, 8), nn.RReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    tm = fxckpt.transform(model, every=1, example_inputs=(x,))
    flags = {s.name: fxckpt.inspect(tm).graph_module.get_submodule(s.name).early_stop
             for s in fxckpt.inspect(tm).plan.segments}
    assert False in flags.values()
    draws = {s.name: fxckpt.inspect(tm).graph_module.get_submodule(s.name).draws
             for s in fxckpt.inspect(tm).plan.segments}
    assert set(draws.values()) == {True, False}  # RReLU draws noise; the last Linear does not
    fxckpt.save(tm, tmp_path / "rrelu")
    loaded = fxckpt.load(tmp_path / "rrelu")
    root = fxckpt.inspect(loaded).graph_module
    assert {name: root.get_submodule(name).early_stop for name in flags} == flags
    assert {name: root.get_submodule(name).draws for name in draws} == draws


def test_loaded_weights_are_aligned_so_one_thread_kernels_round_as_the_models(
        tmp_path: Path) -> None:
    """On one thread, oneDNN's convolutions take another path for data that is not 64-byte
    aligned, and round differently: tensors viewed at their offsets in the weights file made a
    loaded RegNet-like model drift from the model it was saved from."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 10, 3, padding=1), torch.nn.BatchNorm2d(10), torch.nn.ReLU(),
            torch.nn.Conv2d(10, 6, 3, padding=1), torch.nn.BatchNorm2d(6), torch.nn.ReLU(),
            torch.nn.Conv2d(6, 4, 1))
        x = torch.randn(2, 3, 12, 12)
        tm = fxckpt.transform(model, every=1, example_inputs=(x,))
        fxckpt.save(tm, tmp_path / "c")
        loaded = fxckpt.load(tmp_path / "c")
        assert {t.data_ptr() % 64 for t in loaded.state_dict().values() if t.numel()} == {0}
        torch.manual_seed(0)
        reference = torch.nn.Sequential(*[copy.deepcopy(m) for m in model])
        assert_steps_equal(run_step(loaded, (x,), {}), run_step(reference, (x,), {}))
    finally:
        torch.set_num_threads(threads)
