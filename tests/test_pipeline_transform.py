"""transform(chunks=, devices=, checkpoint=) runs the model as a GPipe pipeline with the same
numbers."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxckpt
from models import MLP, Shuffled, UNet, gpt2
from support import assert_steps_equal, loss_of, run_step


def test_one_chunk_one_device_is_bit_identical() -> None:
    model = MLP(depth=4)
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, every=2, chunks=1, devices=["cpu"])
    x = torch.randn(8, 32, requires_grad=True)
    assert_steps_equal(run_step(tm, (x,), {}), run_step(reference, (x,), {}))


@pytest.mark.parametrize(
    "mode,expected", [("always", 4 * 2), ("except_last", 3 * 2), ("never", 0)]
)
def test_micro_batches_over_two_stages_match_eager(mode: str, expected: int) -> None:
    model = UNet()
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, depth=2, chunks=4, devices=["cpu", "cpu"], checkpoint=mode)
    x = torch.randn(8, 1, 8, 8, requires_grad=True)
    got, want = tm(x), reference(x)
    loss_of(got).backward()
    grad_x = x.grad.clone()
    x.grad = None
    loss_of(want).backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_x, x.grad, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert len(set(fxckpt.inspect(tm).pipeline.recomputed)) == expected
    view = fxckpt.inspect(tm).plan.pipeline
    assert view is not None and len(view.stages) == 2 and view.bubble == pytest.approx(1 / 5)
    assert "GPipe fill-drain" in str(fxckpt.inspect(tm).plan)


@pytest.mark.slow
def test_hf_gpt2_pipeline_keeps_its_output_type() -> None:
    model = gpt2(layers=2)
    model.config.resid_pdrop = model.config.embd_pdrop = model.config.attn_pdrop = 0.0
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (4, 12))
    tm = fxckpt.transform(model, chunks=2, devices=["cpu", "cpu"])
    got, want = tm(ids), reference(ids)
    assert type(got) is type(want)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-6)


def test_eval_pipeline_recomputes_nothing() -> None:
    tm = fxckpt.transform(MLP(), chunks=2, devices=["cpu", "cpu"], checkpoint="always").eval()
    loss_of(tm(torch.randn(4, 32))).backward()
    assert fxckpt.inspect(tm).pipeline.recomputed == []


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"chunks": 0}, "chunks must be a positive integer (got 0)"),
        ({"chunks": -2}, "chunks must be a positive integer (got -2)"),
        ({"chunks": 2.5}, "chunks must be a positive integer (got 2.5)"),
        (
            {"chunks": 2, "checkpoint": "sometimes"},
            "checkpoint must be one of 'always', 'except_last', 'never' (got 'sometimes')",
        ),
        ({"devices": ["cuda:7"]}, "cuda:7"),
        ({"devices": "cpu"}, "devices must be a list (got 'cpu')"),
        ({"chunks": 2, "stages": 0}, "stages must be a positive integer (got 0)"),
    ],
)
def test_bad_pipeline_options(kwargs: dict, message: str) -> None:
    with pytest.raises(fxckpt.ConfigError) as e:
        fxckpt.transform(MLP(), **kwargs)
    assert message in str(e.value)


def test_bad_pipeline_options_found_when_planning() -> None:
    x = torch.randn(4, 32)
    with pytest.raises(fxckpt.ConfigError, match="stages must be at most the graph's"):
        fxckpt.transform(MLP(depth=1), chunks=2, devices=["cpu"] * 40, example_inputs=(x,))
    with pytest.raises(fxckpt.ConfigError, match="balance"):
        fxckpt.transform(
            MLP(), chunks=2, devices=["cpu", "cpu"], balance=[1, 2], example_inputs=(x,)
        )

    class TwoInputs(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a.sum(1) + b.sum(1)

    tm = fxckpt.transform(TwoInputs(), chunks=2, devices=["cpu"])
    with pytest.raises(ValueError, match="batch"):
        tm(torch.randn(4, 3), torch.randn(5, 3))


@pytest.mark.slow
def test_hf_gpt2_micro_batches_need_not_divide_the_batch() -> None:
    """Batch 8 in chunks=7 (micro-batches 2, 1, 1, 1, 1, 1, 1): the exported graph's batch is
    dynamic, so one capture and one plan serve every micro-batch size."""
    model = gpt2(layers=2)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (8, 12))
    tm = fxckpt.transform(model, depth=3, chunks=7, devices=["cpu", "cpu"])
    got, want = tm(ids), reference(ids)
    loss, expected = loss_of(got.logits), loss_of(want.logits)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    info = fxckpt.inspect(tm)
    assert (info.captures, info.plans_made) == (1, 1)
    assert sorted({i for i, _ in info.pipeline.recomputed}) == list(range(6))  # except_last: 7 - 1


class PerSample(torch.nn.Module):
    """Python that loops over the batch: torch.export specialises the batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.fc(x[i:i + 1]) for i in range(x.shape[0])])


def test_graphs_specialised_to_one_batch_size_need_an_even_split() -> None:
    message = (r"specialised this graph to one micro-batch size .* the batch \({}\) must split "
               r"evenly into chunks=2")
    with pytest.raises(fxckpt.ConfigError, match=message.format(7)):
        fxckpt.transform(PerSample(), every=1, chunks=2, devices=["cpu"] * 2)(torch.randn(7, 4))
    tm = fxckpt.transform(PerSample(), every=1, chunks=2, devices=["cpu"] * 2)
    assert tm(torch.randn(8, 4)).shape == (8, 4)
    with pytest.raises(fxckpt.ConfigError, match=message.format(7)):
        tm(torch.randn(7, 4))  # micro-batches of 4 and 3 for a graph made for 4


@pytest.mark.parametrize("every", [None, 1])
def test_stage_table_names_the_modules_each_stage_runs_in_order(every: int | None) -> None:
    """Blocks called out of order (layers.3 first), with and without lowered segments."""
    from fxckpt.capture.graphs import outermost

    options = {} if every is None else {"every": every}
    tm = fxckpt.transform(Shuffled(), **options, chunks=2, devices=["cpu", "cpu"])
    tm(torch.randn(4, 32)).sum().backward()
    seen = fxckpt.inspect(tm)
    plan, view = seen.plan, seen.view
    assert plan.pipeline is not None
    stages = plan.pipeline.stages
    ran = [m for s in stages for m in s.modules]
    assert ran == ["layers.3", "layers.1", "layers.0", "layers.2", "head"]
    assert all(s.modules for s in stages)
    assert sum(s.nodes for s in stages) == plan.node_count
    ops = sorted((n for n, d in view.nodes(data=True) if d["kind"] == "op"),
                 key=lambda n: view.nodes[n]["position"])
    for s in stages:  # the table agrees with the stage every node of the flat graph runs in
        mine = [view.nodes[n]["module_path"] for n in ops if view.nodes[n]["stage"] == s.stage]
        assert s.modules == outermost(p for p in mine if p), s.stage
        assert s.nodes == sum(1 for n in ops if view.nodes[n]["stage"] == s.stage)


class StoresMap(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.last = h.detach()
        return self.b(h)


def test_an_attribute_the_forward_assigns_is_refused_under_micro_batches() -> None:
    tm = fxckpt.transform(StoresMap(), every=1, chunks=2, devices=["cpu", "cpu"])
    with pytest.raises(fxckpt.PlanError, match=r"assigns `last`, and a pipeline runs it once per"):
        tm(torch.randn(4, 8))
