"""fxckpt on diffusers denoisers: a UNet (Stable Diffusion's shape) and a DiT transformer.

Each model is built from a tiny config with random weights and trained the way diffusers'
training scripts train it: latents, Gaussian noise, random timesteps, the noisy latents from a
``DDPMScheduler``, the model predicts the noise, MSE loss. Against the same model without fxckpt
(a deep copy, the same data), every loss, every gradient and every weight after 3 AdamW steps must
be bit-identical.

A user who already turned on diffusers' own checkpointing (``enable_gradient_checkpointing()``)
and then transforms gets fxckpt's checkpointing only: fxckpt switches the model's own off (its
``disable_gradient_checkpointing()``), so no layer is recomputed twice.

Memory: ``budget=0.5`` must lower the measured peak of a training step to about half of the
unmodified model's, measured as the design notes say (in a fresh process with
``MALLOC_MMAP_THRESHOLD_``, resident memory and the live-tensor tracker both).
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxckpt
from fxckpt.measure import run_in_subprocess, step_memory

pytest.importorskip("diffusers")

pytestmark = pytest.mark.frameworks

STEPS = 3
Batch = dict[str, torch.Tensor]  # latents, noise, timesteps and the model's conditioning


def _unet() -> nn.Module:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, block_out_channels=(32, 64),
        layers_per_block=1, cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    )


def _dit(size: int = 16) -> nn.Module:
    from diffusers import DiTTransformer2DModel

    return DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        num_layers=2, sample_size=size, patch_size=2, num_embeds_ada_norm=10, norm_num_groups=8,
    )


def _unet_batch(g: torch.Generator, n: int, size: int = 16) -> Batch:
    return {"latents": torch.randn(n, 4, size, size, generator=g),
            "encoder_hidden_states": torch.randn(n, 8, 32, generator=g)}


def _dit_batch(g: torch.Generator, n: int, size: int = 16) -> Batch:
    return {"latents": torch.randn(n, 4, size, size, generator=g),
            "class_labels": torch.randint(0, 10, (n,), generator=g)}


def _noised(batch: Batch, g: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The model's keyword inputs (noisy latents at random timesteps) and the noise to predict."""
    from diffusers import DDPMScheduler

    scheduler = DDPMScheduler(num_train_timesteps=1000)
    latents = batch["latents"]
    noise = torch.randn(latents.shape, generator=g)
    timesteps = torch.randint(0, 1000, (latents.shape[0],), generator=g)
    cond = {k: v for k, v in batch.items() if k != "latents"}
    noisy = scheduler.add_noise(latents, noise, timesteps)
    return {"hidden_states" if "class_labels" in cond else "sample": noisy,
            "timestep": timesteps, **cond}, noise


def _denoising_loss(model: nn.Module, inputs: dict[str, torch.Tensor],
                    noise: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(**inputs).sample, noise)


# name -> (build the model, a batch of its data)
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator, int], Batch]]] = {
    "unet": (_unet, _unet_batch),
    "dit": (_dit, _dit_batch),
}


def _data(batch_of: Callable[[torch.Generator, int], Batch]) -> list[tuple[dict, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [_noised(batch_of(g, 2), g) for _ in range(STEPS)]


Trained = tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def _train(model: nn.Module, data: list[tuple[dict, torch.Tensor]]) -> Trained:
    """Losses and gradients of each AdamW step, and the weights after the last."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], []
    torch.manual_seed(3)  # DiT drops class labels at random: the same draws in both runs
    for inputs, noise in data:
        loss = _denoising_loss(model, inputs, noise)
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_same(got: Trained, want: Trained, n_params: int) -> None:
    for step, (g, w) in enumerate(zip(got[0], want[0], strict=True)):
        assert torch.equal(g, w), f"step {step}: loss {g} != {w}"
    for step, (gs, ws) in enumerate(zip(got[1], want[1], strict=True)):
        assert gs.keys() == ws.keys() and len(ws) > 0.9 * n_params, (step, len(gs), len(ws))
        for name in ws:
            assert torch.equal(gs[name], ws[name]), f"step {step}: grad of {name} differs"
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        assert torch.equal(got[2][name], want[2][name]), f"{name} differs after {STEPS} steps"


def _checkpointed(tm: nn.Module) -> set[str]:
    return {p for s in fxckpt.inspect(tm).plan.segments for p in s.module_paths}


@pytest.mark.parametrize("case", sorted(CASES))
def test_denoising_steps_match_the_plain_model(case: str) -> None:
    build, batch_of = CASES[case]
    model, data = build(), _data(batch_of)
    plain = copy.deepcopy(model)
    n_params = len(list(model.parameters()))
    tm = fxckpt.transform(model, depth=2)

    got, want = _train(tm, data), _train(plain, data)

    blocks = _checkpointed(tm)
    expected = {"up_blocks.1", "mid_block.attentions.0"} if case == "unet" else {
        "transformer_blocks.0", "transformer_blocks.1"}
    assert expected <= blocks, sorted(blocks)
    _assert_same(got, want, n_params)


def test_own_gradient_checkpointing_is_switched_off(caplog: pytest.LogCaptureFixture) -> None:
    """``enable_gradient_checkpointing()`` before ``transform``: fxckpt turns it off (both
    libraries mark a layer by a boolean ``gradient_checkpointing``, and diffusers' ModelMixin has
    ``is_gradient_checkpointing`` and ``disable_gradient_checkpointing()`` as transformers has),
    so the layers' own ``torch.utils.checkpoint`` never runs under fxckpt's segments."""
    model, data = _unet(), _data(_unet_batch)[:1]
    plain = copy.deepcopy(model)
    own_calls = [0]

    def own_checkpoint(module: nn.Module, *args: Any) -> Any:
        own_calls[0] += 1
        return torch.utils.checkpoint.checkpoint(module.__call__, *args, use_reentrant=False)

    model.enable_gradient_checkpointing(gradient_checkpointing_func=own_checkpoint)
    assert model.is_gradient_checkpointing
    with caplog.at_level(logging.WARNING, logger="fxckpt"):
        tm = fxckpt.transform(model, depth=2)
    assert not model.is_gradient_checkpointing and not tm.is_gradient_checkpointing
    assert any("checkpointing" in r.getMessage() for r in caplog.records
               if r.name.startswith("fxckpt")), "fxckpt says that it turned it off"

    got, want = _train(tm, data), _train(plain, data)
    assert own_calls == [0], "diffusers' own checkpointing ran under fxckpt"
    assert {"up_blocks.1", "mid_block.attentions.0"} <= _checkpointed(tm)
    _assert_same(got, want, len(list(model.parameters())))


def dit_step_memory(budget: float, batch: int, size: int) -> dict[str, Any]:
    """Subprocess target: peak activation memory of a DiT training step, unmodified and under
    ``budget``, both measured in this process (RSS protocol, then the live-tensor tracker)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _dit(size)
    plain = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    inputs, noise = _noised(_dit_batch(g, batch, size), g)

    def loss_fn(out: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        return F.mse_loss(out.sample, noise)

    tm = fxckpt.transform(model, budget=budget, loss_fn=loss_fn, example_kwargs=inputs)
    plan = fxckpt.inspect(tm).plan
    result: dict[str, Any] = {"segments": len(plan.segments), "budget": plan.budget_bytes,
                              "verified_peak": plan.verified_peak}
    for name, module in (("eager", plain), ("fxckpt", tm)):
        torch.manual_seed(1)  # DiT drops class labels at random (class_dropout_prob=0.1)
        result[name] = step_memory(lambda m=module: _denoising_loss(m, inputs, noise).backward())
    # Both took the same steps (1 warm-up, 3 measured, 1 tracked) from the same RNG state: the
    # same summed gradients, bit for bit.
    result["same_grads"] = all(torch.equal(p.grad, q.grad)
                               for p, q in zip(tm.parameters(), plain.parameters(), strict=True))
    return result


def test_budget_lowers_the_measured_peak_of_a_training_step() -> None:
    result = run_in_subprocess(f"{__name__}:dit_step_memory",
                               {"budget": 0.5, "batch": 8, "size": 32})
    eager, checkpointed = result["eager"], result["fxckpt"]
    assert result["segments"] > 0 and result["same_grads"], result
    # The tracker (live tensor bytes) and resident memory must tell the same story.
    assert eager["tracked_bytes"] > 8 * 2**20, eager  # activations dominate the step
    assert checkpointed["tracked_bytes"] <= 0.6 * eager["tracked_bytes"], result
    assert checkpointed["rss_bytes"] <= 0.7 * eager["rss_bytes"], result
    assert checkpointed["tracked_bytes"] <= 1.05 * result["budget"], result
