"""fxckpt stages run by torch.distributed.pipelining: 2 CPU processes over gloo vs one process."""

from __future__ import annotations

import copy
import subprocess
import sys
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fxckpt
import fxckpt.pipeline.distributed as fd
import gloo
from fxckpt.config import TransformConfig
from fxckpt.errors import ConfigError
from fxckpt.cost.annotate import annotate
from fxckpt.capture.captured import capture
from fxckpt.passes.lower import lower
from fxckpt.planning.select import select
from fxckpt.pipeline.partition import partition
from fxckpt.pipeline.split import split_stages
from models import MLP


def _sum_sq(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).sum()


def _stages(model: torch.nn.Module, x: torch.Tensor) -> list:
    """Two stages of ``model``, each with its own lowered checkpoint segments inside."""
    captured = capture(model, (x,), {})
    annotate(captured.gm, [x])
    plan = select(captured.gm, TransformConfig.from_options(every=1), capture=captured.method,
                  training=True, signature="")
    lower(captured.gm, plan)
    return split_stages(captured.gm, partition(captured.gm, 2, plan=plan).stage_of)


def _all_names(mine: list[str]) -> list[str]:
    held: list = [None] * dist.get_world_size()
    dist.all_gather_object(held, mine)
    return sorted(n for h in held for n in h)


def _mlp_stages(rank: int, world: int, checkpoint_dir: str) -> None:
    torch.manual_seed(0)
    model = MLP(depth=4, p=0.0)
    x, y = torch.randn(8, 32), torch.randn(8, 4)
    reference = copy.deepcopy(model)
    expected_loss = _sum_sq(reference(x), y)
    expected_loss.backward()
    tm = fxckpt.transform(model, every=1, stages=2, chunks=4)
    for kind, recompute in (("gpipe", False), ("1f1b", True)):
        model.zero_grad(set_to_none=True)
        stage = fd.build_stage(tm, rank, "cpu", recompute=recompute, example_inputs=(x,))
        run = fd.schedule(stage, kind, n_microbatches=4, loss_fn=_sum_sq, scale_grads=False)
        if rank == 0:
            run.step(x)
        else:
            losses: list = []
            run.step(target=y, losses=losses)
            torch.testing.assert_close(sum(losses), expected_loss.detach(), rtol=1e-5, atol=1e-6)
        mine = dict(stage.submod.named_parameters())  # the model's own names
        assert mine and set(stage.submod.state_dict()) <= set(model.state_dict()), sorted(mine)
        for name, p in mine.items():
            assert p is model.get_parameter(name)
            want = reference.get_parameter(name).grad
            torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{kind}, rank {rank}, grad of {name}: {m}")
        assert _all_names(sorted(stage.submod.state_dict())) == sorted(model.state_dict())
    _save_and_reload(stage, reference, rank, checkpoint_dir)


def _save_and_reload(stage: object, reference: nn.Module, rank: int, checkpoint_dir: str) -> None:
    """One SGD step per rank on its stage, saved with DCP and loaded into an unmodified model."""
    import torch.distributed.checkpoint as dcp

    torch.optim.SGD(stage.submod.parameters(), lr=0.1).step()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    dcp.save(stage.submod.state_dict(), checkpoint_id=checkpoint_dir)
    torch.manual_seed(100 + rank)
    fresh = MLP(depth=4, p=0.0)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=checkpoint_dir)
    fresh.load_state_dict(state)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(fresh.get_parameter(name), p, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_stages_from_the_transformed_module_match_one_process_and_checkpoint(tmp_path) -> None:
    """GPipe and 1F1B over 2 ranks: loss and every gradient equal a single-process step; the
    stages hold the model's names, and a DCP checkpoint of them loads into the plain model."""
    gloo.run(_mlp_stages, str(tmp_path / "ckpt"))


def _bn_model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(),
                         nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _batchnorm_stages(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = _bn_model()
    reference = copy.deepcopy(model)
    x, y = torch.randn(12, 6), torch.randn(12, 3)
    for xs, ys in zip(x.chunk(3), y.chunk(3)):  # micro-batch by micro-batch: 3 statistics updates
        _sum_sq(reference(xs), ys).backward()
    tm = fxckpt.transform(model, every=1, stages=2)  # a BatchNorm in each stage
    stage = fd.build_stage(tm, rank, "cpu", recompute=True, example_inputs=(x,))
    run = fd.schedule(stage, "gpipe", n_microbatches=3, loss_fn=_sum_sq, scale_grads=False)
    if rank == 0:
        run.step(x)
    else:
        run.step(target=y)
    buffers = dict(stage.submod.named_buffers())
    assert buffers and set(buffers) <= set(model.state_dict())
    for name, b in buffers.items():
        want = reference.get_buffer(name)
        if name.endswith("num_batches_tracked"):
            assert int(b) == int(want) == 3, f"rank {rank}: {name} is {int(b)}, want 3"
        else:
            torch.testing.assert_close(b, want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}, {name}: {m}")
    for name, p in stage.submod.named_parameters():
        want = reference.get_parameter(name).grad
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_recomputed_stages_update_batchnorm_once_per_micro_batch() -> None:
    gloo.run(_batchnorm_stages)


def _gpt2(tied: bool) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=64, bos_token_id=0,
                     eos_token_id=0, use_cache=False, tie_word_embeddings=tied, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _logits_sum_sq(out: tuple, target: torch.Tensor) -> torch.Tensor:
    return out[0].pow(2).sum()  # an exported graph's last stage returns the flat outputs


def _gpt2_stages(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model, x = _gpt2(tied=False), torch.randint(0, 64, (8, 12))
    reference = copy.deepcopy(model)
    reference(x).logits.pow(2).sum().backward()
    tm = fxckpt.transform(model, depth=3, stages=2, chunks=4)
    stage = fd.build_stage(tm, rank, "cpu", example_inputs=(x,))
    run = fd.schedule(stage, "1f1b", n_microbatches=4, loss_fn=_logits_sum_sq, scale_grads=False)
    if rank == 0:
        run.step(x)
    else:
        run.step(target=torch.zeros(8))
    assert _all_names(sorted(stage.submod.state_dict())) == sorted(model.state_dict())
    for name, p in stage.submod.named_parameters():
        want = reference.get_parameter(name).grad
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_gpt2_stages_across_ranks_send_only_tensors() -> None:
    """An exported GPT-2 (dynamic sizes) over 2 ranks: every gradient equals one process's."""
    pytest.importorskip("transformers")
    gloo.run(_gpt2_stages)


@pytest.mark.slow
def test_parameters_two_stages_use_are_refused() -> None:
    """Tied embeddings in stages 0 and 1: each rank would train its own copy."""
    pytest.importorskip("transformers")
    tm = fxckpt.transform(_gpt2(tied=True), depth=3, stages=2, chunks=4)
    message = (r"parameters used by more than one stage: lm_head.weight \(stages \[0, 1\]\).*"
               r"tie_word_embeddings=False")
    with pytest.raises(ConfigError, match=message):
        fd.build_stage(tm, 0, "cpu", example_inputs=(torch.randint(0, 64, (8, 12)),))


class Renamed(nn.Module):
    """A child named like a GraphModule attribute (renamed in the graph), a BatchNorm, and a
    non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.graph = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.graph(x)) * self.scale)


def test_stage_modules_use_the_model_names() -> None:
    model, x = Renamed(), torch.randn(6, 4)
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, every=1, stages=2, example_inputs=(x,))
    graphs = fxckpt.inspect(tm).pipeline.stage_modules
    assert any(n.startswith("segment_") for g in graphs for n, _ in g.named_parameters())
    stages = [fd.StageModule(g, i, model) for i, g in enumerate(graphs)]
    names = [set(s.state_dict()) for s in stages]
    assert names[0] | names[1] == set(model.state_dict()) and not names[0] & names[1]
    assert "scale" in dict(stages[0].named_buffers()) | dict(stages[1].named_buffers())
    assert all(p is model.get_parameter(n) for s in stages for n, p in s.named_parameters())
    out = stages[1](*(lambda o: o if isinstance(o, tuple) else (o,))(stages[0](x)))
    torch.testing.assert_close(out, reference(x))
    plain = fd.stage_state(graphs[0])  # without the model: every tensor the graph holds
    assert set(plain) >= names[0]


def test_fxckpt_distributed_is_reached_from_import_fxckpt() -> None:
    code = ("import sys, fxckpt; assert 'fxckpt.pipeline.distributed' not in sys.modules; "
            "assert 'torch.distributed.pipelining' not in sys.modules; "
            "assert callable(fxckpt.distributed.build_stage); "
            "assert 'distributed' in fxckpt.__all__")
    subprocess.run([sys.executable, "-c", code], check=True, env=None)


class SizeUser(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        n = h.size(0)  # made in stage 0, used in stage 1: an int crossing the boundary
        return self.fc2(h).reshape(n, 2, 2)


def test_values_that_are_not_tensors_cannot_cross_ranks() -> None:
    x = torch.randn(2, 4)
    captured = capture(SizeUser(), (x,), {})
    annotate(captured.gm, [x])
    stages = split_stages(captured.gm, partition(captured.gm, balance=["fc2"]).stage_of)
    with pytest.raises(
        ConfigError, match=r"stage 1 sends or receives non-tensor values \['size'\]"
    ):
        fd.build_stage(stages, 1, "cpu")


X = torch.randn(4, 32)
BAD_SOURCES = [
    (lambda: MLP(depth=2), {}, r"stages must be a module fxckpt.transform returned .*\(got MLP\)"),
    (lambda: fxckpt.transform(MLP(depth=2), every=1), {},
     r"MLP was transformed without stages; transform it with stages=K \(one per rank\)"),
    (lambda: fxckpt.transform(MLP(depth=2), every=1, stages=2), {},
     r"has not planned yet, so it has no stages to build: .*pass example_inputs=\(batch,\) "
     r"to build_stage"),
    (lambda: fxckpt.transform(MLP(depth=2), every=1, stages=2), {"example_inputs": X},
     r"example_inputs must be a tuple of positional inputs \(got Tensor\)"),
]


@pytest.mark.parametrize("make,options,message", BAD_SOURCES)
def test_what_build_stage_cannot_take(make: Callable, options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        fd.build_stage(make(), 0, "cpu", **options)


def test_bad_arguments_are_rejected() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 32)
    stages = _stages(MLP(depth=2, p=0.0), x)
    with pytest.raises(ConfigError, match=r"stage_index must be an integer in \[0, 1\] \(got 2\)"):
        fd.build_stage(stages, 2, "cpu")
    with pytest.raises(ConfigError, match="does not exist"):
        fd.build_stage(stages, 0, "cuda:7")
    with pytest.raises(ConfigError, match=r"example_inputs= plans a transformed module.*got list"):
        fd.build_stage(stages, 0, "cpu", example_inputs=(x,))
    with pytest.raises(
        ConfigError, match=r"schedule kind must be one of \('gpipe', '1f1b'\) \(got 'zb'\)"
    ):
        fd.schedule(object(), "zb", 4)
    with pytest.raises(ConfigError, match=r"n_microbatches must be a positive integer \(got 0\)"):
        fd.schedule(object(), "gpipe", 0)
