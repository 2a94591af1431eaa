"""Planning on the meta device: plan a model with no memory for it, then train the real
one with the same plan, exact against eager; and ``fxckpt plan CONFIG.json --meta``."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fxckpt
from fxckpt.__main__ import main
from fxckpt.errors import PlanError

transformers = pytest.importorskip("transformers")

SMALL = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def llama_config() -> "transformers.LlamaConfig":
    return transformers.LlamaConfig(**SMALL, use_cache=False, attn_implementation="sdpa")


def ids(device: str = "cpu") -> torch.Tensor:
    return torch.randint(SMALL["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(1)
                         ).to(device)


def meta_plan(budget: float = 0.5) -> fxckpt.Plan:
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config()).train()
    tm = fxckpt.transform(model, budget=budget, example_inputs=(ids("meta"),))
    assert all(p.is_meta for p in model.parameters())
    return fxckpt.inspect(tm).plan


def step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x).logits
    torch.nn.functional.cross_entropy(out.flatten(0, 1), x.flatten()).backward()
    return out


def assert_exact(tm: torch.nn.Module, model: torch.nn.Module, ref: torch.nn.Module) -> None:
    x = ids()
    assert torch.equal(step(tm, x), step(ref, x))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        assert torch.equal(b, c), name


@pytest.fixture(scope="module")
def plan() -> fxckpt.Plan:
    return meta_plan()


def test_plan_made_on_meta_trains_the_materialised_model_exactly(plan: fxckpt.Plan) -> None:
    assert plan.segments and plan.strategy == "budget"
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config()).train()
    model.to_empty(device="cpu")  # the recipe of docs/meta.md: to_empty, then initialise
    torch.manual_seed(0)
    model.apply(model._init_weights)
    fresh = transformers.LlamaForCausalLM(llama_config())
    # Initialising covers the non-persistent buffers too (RoPE's inv_freq): the model is whole.
    assert torch.equal(model.model.rotary_emb.inv_freq, fresh.model.rotary_emb.inv_freq)
    ref = copy.deepcopy(model)
    tm = fxckpt.transform(model, plan=plan)
    assert_exact(tm, model, ref)
    replayed = fxckpt.inspect(tm).plan
    # The CPU capture names nodes differently (a `contiguous` the meta kernels need, and every
    # later counter shifted), so the segments were found by their anchors: same count, same
    # modules, same kept outputs.
    cpu_names = {n for s in replayed.segments for n in s.nodes}
    assert {n for s in plan.segments for n in s.nodes} != cpu_names
    assert replayed.strategy == "replay"
    assert [s.module_paths for s in replayed.segments] == [s.module_paths for s in plan.segments]
    assert [s.kept_ops for s in replayed.segments] == [s.kept_ops for s in plan.segments]
    assert sum(s.recompute_flops for s in replayed.segments) > 0


def test_plan_made_on_meta_replays_on_a_model_built_normally(plan: fxckpt.Plan) -> None:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config()).train()
    ref = copy.deepcopy(model)
    tm = fxckpt.transform(model, plan=json.loads(json.dumps(plan.to_dict())))  # as saved to disk
    assert_exact(tm, model, ref)
    assert len(fxckpt.inspect(tm).plan.segments) == len(plan.segments)


def test_plan_of_another_model_is_refused_by_its_anchors(plan: fxckpt.Plan) -> None:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                  bos_token_id=0, eos_token_id=0, use_cache=False)
    tm = fxckpt.transform(transformers.GPT2LMHeadModel(cfg).train(), plan=plan)
    with pytest.raises(PlanError, match=r"segment_\d+ names node '\w+', which this model's "
                       r"graph does not have \(nor the module and op its anchors name\)"):
        tm(ids())


def write_config(tmp_path: Path, **extra: object) -> Path:
    data = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SMALL,
            "torch_dtype": "bfloat16", **extra}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


def test_cli_plans_a_hugging_face_config_on_meta_and_writes_a_replayable_plan(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = write_config(tmp_path)
    out = tmp_path / "plan.json"
    assert main(["plan", str(tmp_path), "--meta", "--input-shape", "2,32", "--dtype", "int64",
                 "--budget", "0.5", "--plan-out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "budget: " in stdout and "segment_0" in stdout and f"plan written to {out}" in stdout
    saved = json.loads(out.read_text())
    assert saved["segments"] and "bfloat16[" not in saved["signature"]  # ids are int64
    # The model was built in the config's dtype: the plan's eager peak is that of bf16 activations,
    # about half the fp32 one of the same config.
    assert main(["plan", str(config), "--meta", "--input-shape", "2,32", "--dtype", "int64",
                 "--budget", "0.5", "--model-dtype", "float32", "--plan-out",
                 str(tmp_path / "fp32.json")]) == 0
    fp32 = json.loads((tmp_path / "fp32.json").read_text())
    assert 0.4 < saved["eager_peak"] / fp32["eager_peak"] < 0.75
    # The written plan trains the real model (built in float32 here) exactly.
    model = transformers.LlamaForCausalLM(llama_config()).train()
    ref = copy.deepcopy(model)
    assert_exact(fxckpt.transform(model, plan=fp32), model, ref)


@pytest.mark.parametrize("argv, message", [
    (["{dir}/nowhere.json"], "no such config file"),
    (["{dir}"], "is a directory without a config.json"),
    (["{dir}/bad.json"], "is not a Hugging Face model config (it has no model_type)"),
    (["{config}", "--meta", "--save", "{dir}/x"], "--meta plans only"),
    (["{config}", "--model-dtype", "floaty"], "is not a torch dtype"),
])
def test_cli_bad_targets_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                      argv: list[str], message: str) -> None:
    config = write_config(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "bad.json").write_text('{"hidden_size": 8}')
    argv = [a.format(dir=tmp_path, config=config) for a in argv]
    argv = [str(empty) if a == str(tmp_path) else a for a in argv]
    code = main(["plan", *argv, "--input-shape", "2,32", "--dtype", "int64", "--budget", "0.5"])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err, err


@pytest.mark.slow
def test_planning_on_meta_takes_no_memory_for_the_model() -> None:
    """A config whose fp32 parameters alone take 1.6 GiB plans in a process whose peak RSS grows
    by far less than that (measured in a fresh process, so nothing else has raised it)."""
    code = """
import resource, torch, transformers, fxckpt
cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5504,
    num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, use_cache=False,
    attn_implementation="sdpa")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(cfg).train()
params = sum(p.numel() * p.element_size() for p in model.parameters())
ids = torch.zeros(4, 1024, dtype=torch.long, device="meta")
plan = fxckpt.inspect(fxckpt.transform(model, budget=0.5, example_inputs=(ids,))).plan
grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
print(params, grown, plan.eager_peak, len(plan.segments))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    params, grown, eager, segments = map(int, out.stdout.split())
    assert params > 1.5 * 2**30 and eager > 2**30 and segments > 0
    assert grown < 0.25 * params, (grown, params)


class _Branches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h) if h.sum() > 0 else h  # data-dependent: no graph on meta


def test_a_meta_model_fxckpt_cannot_capture_gets_fxckpts_error_not_the_meta_devices() -> None:
    """The model's own error is asked for when capture fails; on meta its eager forward stops at
    ``.item()``, which is the meta device's limit, not the model's refusal."""
    with torch.device("meta"):
        model = _Branches()
    with pytest.raises(fxckpt.CaptureError, match="could not capture _Branches") as caught:
        fxckpt.transform(model, every=1, example_inputs=(torch.empty(4, 8, device="meta"),))
    assert "control flow" in str(caught.value) and "meta tensors" not in str(caught.value)
