"""Meta models are annotated and verified on their meta tensors, not on fake tensors wrapping them
(:mod:`fxckpt.measure.meta_run`): the same records and peaks, the model left as it was, and fake
tensors wherever meta tensors cannot run the step."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import is_fake

import fxckpt
from fxckpt.measure.meta_run import meta_twin, on_meta
from fxckpt.capture.captured import capture
from fxckpt.capture.graphs import copy_graph_module
from fxckpt.measure.tracker import _tensor_leaves
from fxckpt.measure.verify import VerifyError, fake_step_peak

annotation = importlib.import_module("fxckpt.cost.annotate")


class Net(nn.Module):
    """Dropout, BatchNorm (buffers written in place), views and a cast, six blocks deep."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 64)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1))
            for _ in range(6))
        self.b = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        for block in self.blocks:
            h = block(h).view(x.shape[0], 64) + h
        return self.b(h.float()).tanh()


def meta_net() -> nn.Module:
    with torch.device("meta"):
        return Net().train()


X = torch.empty(64, 16, device="meta")


def both_ways(model: nn.Module, x: torch.Tensor, method: str) -> tuple:
    captured = capture(model, (x,), {}, method=method)
    values = captured.graph_args((x,), {})
    on, off = copy_graph_module(captured.gm), copy_graph_module(captured.gm)
    annotation.annotate(on, values)
    real = annotation.on_meta
    annotation.on_meta = lambda *_: False
    try:
        annotation.annotate(off, values)
    finally:
        annotation.on_meta = real
    return captured, on, off


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_annotations_on_meta_tensors_are_those_on_fake_tensors(method: str) -> None:
    model = meta_net()
    captured, on, off = both_ways(model, X, method)
    assert on_meta(on, tuple(captured.graph_args((X,), {})), {})
    records = [(a.name, a.meta.get("fxckpt"), b.meta.get("fxckpt"))
               for a, b in zip(on.graph.nodes, off.graph.nodes)]
    assert all(r[1] is not None for r in records[:-1])
    assert [r[1] for r in records] == [r[2] for r in records]
    assert all(p.is_meta and p.grad is None for p in model.parameters())


def test_verified_peaks_on_meta_tensors_are_those_on_fake_tensors() -> None:
    model = meta_net()
    versions = [b._version for b in model.buffers()]
    for loss_fn in (None, lambda out, x: out.square().mean()):
        run = lambda a, k: model(*a, **k)  # noqa: E731
        on = fake_step_peak(model, run, (X,), {}, loss_fn=loss_fn)
        off = fake_step_peak(model, run, (X,), {}, loss_fn=loss_fn, meta=False)
        assert on == off > 0
    assert all(p.grad is None for p in model.parameters())
    assert [b._version for b in model.buffers()] == versions  # twins were written, not these


def test_a_meta_plan_is_the_plan_made_on_fake_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    model = meta_net()
    plan = fxckpt.inspect(fxckpt.transform(model, budget=0.5, example_inputs=(X,))).plan
    monkeypatch.setattr(annotation, "on_meta", lambda *_: False)
    monkeypatch.setattr("fxckpt.measure.verify.on_meta", lambda *_: False)
    faked = fxckpt.inspect(fxckpt.transform(meta_net(), budget=0.5, example_inputs=(X,))).plan
    assert plan.verified_peak is not None
    assert plan.to_dict() == faked.to_dict()


def test_only_steps_wholly_on_meta_run_on_meta_tensors() -> None:
    model = meta_net()
    assert on_meta(model, (X,), {})
    assert not on_meta(Net(), (torch.randn(64, 16),), {})
    assert not on_meta(model, (torch.randn(64, 16),), {})  # an input elsewhere
    mixed = meta_net()
    mixed.register_buffer("scale", torch.ones(()))  # a CPU buffer
    assert not on_meta(mixed, (X,), {})

    class Moves(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.ones(16, device="cpu")

    gm = torch.fx.symbolic_trace(Moves())
    assert not on_meta(gm, (X,), {})  # a graph that makes tensors on the CPU


def test_a_step_meta_tensors_cannot_run_is_faked(caplog: pytest.LogCaptureFixture) -> None:
    model = meta_net()

    def loss_fn(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if not is_fake(out):  # as an op without a meta kernel does
            raise NotImplementedError("no kernel for meta tensors")
        return out.square().mean()

    run = lambda a, k: model(*a, **k)  # noqa: E731
    with caplog.at_level("DEBUG", logger="fxckpt.measure.verify"):
        peak = fake_step_peak(model, run, (X,), {}, loss_fn=loss_fn)
    assert "faking them" in caplog.text
    assert peak == fake_step_peak(model, run, (X,), {}, loss_fn=loss_fn, meta=False) > 0

    def reads(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return out.sum() * float(out.sum())  # a value: neither meta nor fake tensors have one

    with pytest.raises(VerifyError, match="fake tensors"):
        fake_step_peak(model, run, (X,), {}, loss_fn=reads)


def test_meta_twins_share_storage_not_versions_nor_gradients() -> None:
    p = nn.Parameter(torch.empty(4, 3, device="meta"))
    twin = meta_twin(p)
    assert isinstance(twin, nn.Parameter) and twin.requires_grad and twin.is_leaf
    assert twin.untyped_storage()._cdata == p.untyped_storage()._cdata
    with torch.no_grad():
        twin.add_(1)
    assert p._version == 0
    view = torch.empty(4, 3, device="meta")[1:]
    assert meta_twin(view).storage_offset() == 3 and not meta_twin(view).requires_grad


def test_tracker_reads_the_tensors_pytree_reads() -> None:
    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    trees = [a, (a, [b, 2, None]), {"x": c, "y": [a, (b,)]}, torch.return_types.max((a, b)),
             [1.0, torch.float32, torch.device("cpu"), "mean"], ()]
    for tree in trees:
        expected = [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
        assert [id(t) for t in _tensor_leaves(tree)] == [id(t) for t in expected]


def test_a_model_planned_on_meta_is_copied_unchanged() -> None:
    model = meta_net()
    before = copy.deepcopy(model.state_dict(keep_vars=True))
    fxckpt.transform(model, budget=0.5, example_inputs=(X,))
    after = model.state_dict(keep_vars=True)
    assert before.keys() == after.keys()
    assert all(after[k].is_meta and after[k].grad is None for k in after)
