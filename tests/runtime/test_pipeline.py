"""The GPipe runner against eager PyTorch: outputs, every gradient, buffers, recompute counts.

BatchNorm models (ResNet) are compared with what GPipe can be equal to: gradients of the eager
model run on each micro-batch (a pipeline normalises each micro-batch with its own statistics),
and buffers of one full-batch BatchNorm update over the activations each layer saw.
"""

from __future__ import annotations

import collections
import copy
import logging
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from fxckpt.errors import ConfigError
from fxckpt.cost.annotate import annotate
from fxckpt.capture.captured import capture
from fxckpt.pipeline.build import PipelinedModule, build_pipeline
from fxckpt.runtime.pipeline import Pipeline
from fxckpt.runtime.schedule import bubble_fraction, clock_cycles
from handmade import annotated
from models import MLP, KwargsDict, ResNet, UNet, gpt2
from support import loss_of, run_step

MODES = ("always", "except_last", "never")
CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (lambda: MLP(p=0.0), (8, 32)),
    "resnet": (ResNet, (8, 3, 8, 8)),
    "unet": (UNet, (8, 1, 8, 8)),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread avoids OpenMP spin-waiting on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _annotated(model: nn.Module, *inputs: torch.Tensor,
               every: int | None = None) -> torch.fx.GraphModule:
    return annotated(model, *inputs, every=every, lowered=True)[0]


def _has_bn(model: nn.Module) -> bool:
    return any(isinstance(m, _BatchNorm) for m in model.modules())


def _full_batch_bn(model: nn.Module, pieces: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Buffers after one BatchNorm update over the inputs each BN layer saw in all
    micro-batches."""
    ref = copy.deepcopy(model)
    norms = {name: m for name, m in ref.named_modules() if isinstance(m, _BatchNorm)}
    before = {name: {k: b.clone() for k, b in m.named_buffers()} for name, m in norms.items()}
    seen: dict[str, list[torch.Tensor]] = collections.defaultdict(list)
    for name, m in norms.items():
        m.register_forward_pre_hook(
            lambda mod, args, name=name: seen[name].append(args[0].detach())
        )
    with torch.no_grad():
        for p in pieces:
            ref(p)
    expected = {}
    for name, m in norms.items():
        b = before[name]
        F.batch_norm(
            torch.cat(seen[name]),
            b["running_mean"],
            b["running_var"],
            None,
            None,
            True,
            m.momentum,
            m.eps,
        )
        b["num_batches_tracked"] += 1
        expected.update({f"{name}.{k}": v for k, v in b.items()})
    return expected


def _reference(
    model: nn.Module, x: torch.Tensor, chunks: int
) -> tuple[torch.Tensor, torch.Tensor, dict, dict]:
    """Eager loss, input grad, parameter grads and buffers the pipeline must reproduce."""
    ref = copy.deepcopy(model)
    xr = x.clone().requires_grad_()
    pieces = list(torch.tensor_split(xr, min(chunks, len(x))))
    if _has_bn(model):
        loss = sum(loss_of(ref(p)) for p in pieces)
        buffers = _full_batch_bn(model, [p.detach() for p in pieces])
    else:
        loss = loss_of(ref(xr))
        buffers = {}
    loss.backward()
    return loss.detach(), xr.grad, {k: p.grad for k, p in ref.named_parameters()}, buffers


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("chunks", [2, 4, 7])
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("name", sorted(CASES))
def test_pipeline_matches_eager(name: str, k: int, chunks: int) -> None:
    make, shape = CASES[name]
    model, x = make(), torch.randn(*shape)
    gm = _annotated(model, x)
    state = copy.deepcopy(model.state_dict())
    loss_ref, xgrad_ref, grads_ref, buffers_ref = _reference(model, x, chunks)
    for mode in MODES:
        model.load_state_dict(state)
        model.zero_grad(set_to_none=True)
        pm = build_pipeline(gm, chunks=chunks, devices=["cpu"] * k, checkpoint=mode)
        xi = x.clone().requires_grad_()
        loss = loss_of(pm(xi))
        after_forward = {n: b.clone() for n, b in model.named_buffers()}
        loss.backward()
        _close(loss.detach(), loss_ref, f"{mode}: loss")
        _close(xi.grad, xgrad_ref, f"{mode}: input grad")
        for n, p in model.named_parameters():
            _close(p.grad, grads_ref[n], f"{mode}: grad of {n}")
        for n, b in model.named_buffers():
            _close(b, buffers_ref[n], f"{mode}: buffer {n}")
            assert torch.equal(b, after_forward[n]), f"{mode}: backward (recompute) changed {n}"
        if name == "resnet":  # the stem's BatchNorm sees the same data as in one full-batch step
            full = copy.deepcopy(model)
            full.load_state_dict(state)
            full(x)
            for n in ("running_mean", "running_var", "num_batches_tracked"):
                _close(
                    model.stem[1].get_buffer(n),
                    full.stem[1].get_buffer(n),
                    f"{mode}: full-batch stem.1.{n}",
                )
        expected = {"always": chunks, "except_last": chunks - 1, "never": 0}[mode] * k
        assert len(pm.recomputed) == expected, mode
        assert len(set(pm.recomputed)) == expected and all(
            i < chunks - (mode != "always") for i, _ in pm.recomputed
        )


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_chunk_on_one_device_is_bit_identical(name: str) -> None:
    make, shape = {**CASES, "mlp": (MLP, (8, 32))}[name]  # the MLP keeps its dropout here
    model, x = make(), torch.randn(*shape, requires_grad=True)
    eager = run_step(copy.deepcopy(model), (x,), {}, seed=7)
    gm = _annotated(model, x)
    state = copy.deepcopy(model.state_dict())
    for mode in ("except_last", "always"):
        model.load_state_dict(state)
        model.zero_grad(set_to_none=True)
        step = run_step(
            build_pipeline(gm, chunks=1, devices=["cpu"], checkpoint=mode), (x,), {}, seed=7
        )
        assert all(torch.equal(a, b) for a, b in zip(step.out, eager.out)), mode
        assert torch.equal(step.input_grads[0], eager.input_grads[0]), mode
        for n, p in model.named_parameters():
            assert torch.equal(p.grad, eager.param_grads[n]), f"{mode}: grad of {n}"
        for n, b in model.named_buffers():
            assert torch.equal(b, eager.buffers[n]), f"{mode}: buffer {n}"


@pytest.mark.parametrize("momentum", [0.1, None])
def test_plain_module_stages_update_batchnorm_once_per_step(momentum: float | None) -> None:
    """A BatchNorm whose input does not depend on earlier normalisation sees the full batch's data:
    its buffers after each pipelined step equal those of a full-batch eager step."""
    stage0 = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5, momentum=momentum), nn.ReLU())
    stage1 = nn.Sequential(nn.Linear(5, 3))
    eager = copy.deepcopy(nn.Sequential(stage0, stage1))
    pipe = Pipeline([stage0, stage1], ["cpu", "cpu"], chunks=3, checkpoint="always")
    for step in range(2):
        x = torch.randn(10, 6)
        loss_of(pipe(x)).backward()
        loss_of(eager(x)).backward()
        assert len(pipe.recomputed) == 3 * 2
        for (n, b), e in zip(stage0[1].named_buffers(), eager[0][1].buffers()):
            _close(b, e, f"step {step}: {n}")
    assert int(stage0[1].num_batches_tracked) == 2
    with pytest.raises(
        ConfigError, match=r"give one device per stage: 2 stage\(s\) but devices=\['cpu'\]"
    ):
        Pipeline([stage0, stage1], ["cpu"], chunks=2)


def test_lowered_segments_and_batchnorm_inside_stages() -> None:
    model, x = ResNet(), torch.randn(8, 3, 8, 8)
    gm = _annotated(model, x, every=1)
    loss_ref, xgrad_ref, grads_ref, buffers_ref = _reference(model, x, 4)
    pm = build_pipeline(gm, chunks=4, devices=["cpu", "cpu"], checkpoint="except_last")
    xi = x.clone().requires_grad_()
    loss_of(pm(xi)).backward()
    assert "fxckpt_checkpoint" in "".join(m.code for m in pm.stage_modules)
    _close(xi.grad, xgrad_ref, "input grad")
    for n, p in model.named_parameters():
        _close(p.grad, grads_ref[n], f"grad of {n}")
    for n, b in model.named_buffers():
        _close(b, buffers_ref[n], f"buffer {n}")
    assert len(pm.recomputed) == 3 * 2


def test_dropout_is_replayed_by_recompute() -> None:
    model, x = MLP(p=0.5), torch.randn(8, 32)
    gm = _annotated(model, x)
    steps = []
    for mode in ("never", "always"):
        model.zero_grad(set_to_none=True)
        steps.append(
            run_step(
                build_pipeline(gm, chunks=4, devices=["cpu"] * 2, checkpoint=mode),
                (x,),
                {},
                seed=3,
            )
        )
        steps[-1].param_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert torch.equal(steps[0].out[0], steps[1].out[0])
    assert all(
        torch.equal(steps[0].param_grads[n], steps[1].param_grads[n]) for n in steps[0].param_grads
    )


def test_eval_and_no_grad_never_recompute() -> None:
    model, x = ResNet(), torch.randn(8, 3, 8, 8)
    pm = build_pipeline(_annotated(model, x), chunks=4, devices=["cpu"] * 2, checkpoint="always")
    before = {n: b.clone() for n, b in model.named_buffers()}
    with torch.no_grad():
        pm(x)
    assert pm.recomputed == [] and pm.pipeline.checkpoint_stop(4) == 4
    pm.eval()
    out = pm(x.requires_grad_())
    loss_of(out).backward()
    assert pm.recomputed == [] and pm.pipeline.checkpoint_stop(4) == 0
    _close(out, copy.deepcopy(model).eval()(x), "eval output")
    assert (
        before["stem.1.num_batches_tracked"] + 1 == model.stem[1].num_batches_tracked
    )  # the no_grad step


def test_each_pair_is_logged_at_debug_only(caplog: pytest.LogCaptureFixture) -> None:
    model, x = MLP(p=0.0), torch.randn(4, 32)
    pm = build_pipeline(_annotated(model, x), chunks=2, devices=["cpu"] * 2,
                        checkpoint="except_last")
    with caplog.at_level(logging.INFO, logger="fxckpt.runtime.pipeline"):
        pm(x)
    assert [r for r in caplog.records if r.name == "fxckpt.runtime.pipeline"] == []
    with caplog.at_level(logging.DEBUG, logger="fxckpt.runtime.pipeline"):
        pm(x)
    pairs = [(r.levelno, r.getMessage()) for r in caplog.records
             if r.name == "fxckpt.runtime.pipeline"]
    checkpointed = "checkpointed, recomputed in backward"
    kept = "not checkpointed, activations kept"
    assert pairs == [
        (logging.DEBUG, f"micro-batch {i}/2 on stage {j} (cpu): {what} (checkpoint_stop=1)")
        for j in range(2) for i, what in ((0, checkpointed), (1, kept))]


def test_a_failing_stage_names_itself_and_leaves_buffers_alone() -> None:
    model, x = ResNet(), torch.randn(8, 3, 8, 8)
    pm = build_pipeline(_annotated(model, x), chunks=4, devices=["cpu"] * 2)
    before = {n: b.clone() for n, b in model.named_buffers()}
    calls = []

    def fail_third(inp: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 3:
            raise FloatingPointError("boom")
        return nn.Linear.forward(model.fc, inp)

    model.fc.forward = fail_third
    with pytest.raises(FloatingPointError, match="boom") as e:
        pm(x)
    assert any("stage 1 on cpu for micro-batch 2 of 4" in note for note in e.value.__notes__)
    for n, b in model.named_buffers():
        assert torch.equal(b, before[n]), n


def test_schedule_and_description() -> None:
    assert [pairs for pairs in clock_cycles(3, 2)] == [
        [(0, 0)],
        [(1, 0), (0, 1)],
        [(2, 0), (1, 1)],
        [(2, 1)],
    ]
    assert bubble_fraction(4, 3) == pytest.approx(2 / 6)
    model, x = MLP(p=0.0), torch.randn(8, 32)
    pm = build_pipeline(_annotated(model, x), chunks=4, devices=["cpu"] * 3)
    text = pm.describe()
    assert "bubble (K-1)/(M+K-1) = 2/6 = 33%" in text
    assert [line.split() for line in text.splitlines() if line.startswith("stage 2")] == [
        ["stage", "2", ".", ".", "0*", "1*", "2*", "3"]
    ]  # except_last: micro-batch 3 keeps activations
    assert "layers.0" in text and text.count("cpu") >= 3


class Masked(nn.Module):
    """A dict output with non-tensor values the same in every micro-batch (and one that is not)."""

    def __init__(self, per_sample: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 3)
        self.per_sample = per_sample

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> dict:
        out = {"logits": self.fc(x * mask), "width": x.shape[1], "kind": "masked", "extra": None}
        if self.per_sample:
            out["n"] = x.shape[0]  # the micro-batch's size, not the batch's
        return out


def _pipelined(model: nn.Module, x: torch.Tensor, mask: torch.Tensor,
               chunks: int = 2) -> PipelinedModule:
    captured = capture(model, (x,), {"mask": mask})
    annotate(captured.gm, captured.graph_args((x,), {"mask": mask}))
    return build_pipeline(captured.gm, chunks=chunks, devices=["cpu"] * 2)


def test_batch_dims_that_disagree_fail_at_the_call() -> None:
    x, mask = torch.randn(4, 16), torch.ones(4, 16)
    pm = _pipelined(Masked(), x, mask)
    with pytest.raises(ValueError, match=r"same batch size along dim 0.*x: 4, mask: 3"):
        pm(x, torch.ones(3, 16))
    out = pm(torch.randn(5, 16), torch.ones(5, 16))  # micro-batches of 3 and 2
    assert out["logits"].shape == (5, 3)
    assert (out["width"], out["kind"], out["extra"]) == (16, "masked", None)


def test_non_tensor_outputs_that_follow_the_batch_size_are_refused() -> None:
    """``x.shape[0]`` is 2 in both micro-batches of a batch of 4: equal, yet not the batch's 4."""
    x, mask = torch.randn(4, 16), torch.ones(4, 16)
    message = (r"output\['n'\] is not a tensor and changes with the batch size .* with chunks=2 "
               r"the model runs on micro-batches")
    for model in (Masked(per_sample=True), KwargsDict()):
        with pytest.raises(ConfigError, match=message):
            _pipelined(model, x, mask)
    assert _pipelined(KwargsDict(), x, mask, chunks=1)(x, mask)["n"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 3])
def test_gpt2_pipeline_matches_eager(k: int) -> None:
    """GPT-2 captured by torch.export at the micro-batch shape (export graphs are
    shape-specialised)."""
    model = gpt2()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    gm = _annotated(model, torch.randint(0, 64, (1, 12)))
    for chunks in (2, 4, 7):
        ids = torch.randint(0, 64, (chunks, 12))
        ref = copy.deepcopy(model)
        loss_ref = loss_of(ref(ids))
        loss_ref.backward()
        for mode in MODES:
            model.zero_grad(set_to_none=True)
            pm: PipelinedModule = build_pipeline(
                gm, chunks=chunks, devices=["cpu"] * k, checkpoint=mode
            )
            out = pm(ids)
            assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
            loss = loss_of(out)
            loss.backward()
            _close(loss.detach(), loss_ref.detach(), f"chunks={chunks} {mode}: loss")
            for n, p in model.named_parameters():
                _close(p.grad, ref.get_parameter(n).grad, f"chunks={chunks} {mode}: grad of {n}")
            assert (
                len(pm.recomputed)
                == {"always": chunks, "except_last": chunks - 1, "never": 0}[mode] * k
            )
    with torch.no_grad():  # called like the model: by keyword too
        assert torch.equal(pm(input_ids=ids).logits, pm(ids).logits)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA device")
def test_cuda_streams_match_eager() -> None:
    devices = ["cuda:0", "cuda:1"] if torch.cuda.device_count() > 1 else ["cpu", "cuda:0"]
    model, x = MLP(p=0.0), torch.randn(8, 32)
    ref = copy.deepcopy(model)
    loss_ref = loss_of(ref(x))
    loss_ref.backward()
    pm = build_pipeline(_annotated(model, x), chunks=4, devices=devices, checkpoint="except_last")
    out = pm(x.to(devices[0]))
    loss = loss_of(out)
    loss.backward()
    torch.cuda.synchronize()
    _close(loss.detach().cpu(), loss_ref.detach(), "loss")
    for n, p in model.named_parameters():
        _close(p.grad.cpu(), ref.get_parameter(n).grad, f"grad of {n}")
