"""fxckpt inside PyTorch Lightning: a ``LightningModule`` whose model is transformed.

The model is transformed either in the LightningModule's ``__init__`` or in its
``configure_model`` hook (the one Lightning calls inside the strategy's context, where FSDP users
build and wrap their model). Each run trains 3 steps with ``L.Trainer`` on the CPU and must equal,
bit for bit, the same LightningModule without fxckpt from the same initial weights, data and RNG
state: the loss of every step, and every parameter and buffer after the last step (GPT-2 with
dropout on: the recompute replays the same dropout masks; a ResNet-style CNN with BatchNorm: its
running statistics update once per step, not once more in the recompute).
"""

from __future__ import annotations

import copy
import os
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxckpt
from models import ResNet

L = pytest.importorskip("lightning")

pytestmark = pytest.mark.frameworks

STEPS = 3
Batch = tuple[torch.Tensor, torch.Tensor]


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=64,
                     bos_token_id=0, eos_token_id=0, use_cache=False)  # dropout 0.1 stays on
    return GPT2LMHeadModel(cfg)


def _gpt2_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    ids, _ = batch
    return model(input_ids=ids, labels=ids).loss


def _gpt2_data() -> torch.utils.data.TensorDataset:
    ids = torch.randint(0, 64, (4 * STEPS, 16))
    return torch.utils.data.TensorDataset(ids, ids)


def _resnet_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _resnet_data() -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(
        torch.randn(4 * STEPS, 3, 12, 12), torch.randint(0, 5, (4 * STEPS,))
    )


# name -> (build the model, its loss on a batch, its data set, the fxckpt strategy)
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module, Batch], torch.Tensor],
                       Callable[[], torch.utils.data.TensorDataset], dict[str, Any]]] = {
    "gpt2": (_gpt2, _gpt2_loss, _gpt2_data, {"depth": 3}),  # transformer.h.0, transformer.h.1
    "resnet": (lambda: ResNet(blocks=3, ch=8), _resnet_loss, _resnet_data, {"depth": 2}),
}


def is_transformed(model: nn.Module) -> bool:
    return isinstance(model, fxckpt.TransformedModule)


class Lit(L.LightningModule):
    """Trains ``model``; ``where`` says where fxckpt transforms it (None: never)."""

    def __init__(self, model: nn.Module, loss: Callable[[nn.Module, Batch], torch.Tensor],
                 where: Optional[str], strategy: dict[str, Any]) -> None:
        super().__init__()
        self.where, self.strategy, self.loss = where, strategy, loss
        self.model = fxckpt.transform(model, **strategy) if where == "__init__" else model
        self.losses: list[torch.Tensor] = []
        self.checkpointed: list[set[str]] = []  # the modules each step's plan recomputes

    def configure_model(self) -> None:
        # Lightning may call this hook more than once: transform once.
        if self.where == "configure_model" and not is_transformed(self.model):
            self.model = fxckpt.transform(self.model, **self.strategy)

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        loss = self.loss(self.model, batch)
        self.losses.append(loss.detach().clone())
        if is_transformed(self.model):
            # Read during the step: Lightning's teardown moves the model (`.cpu()`), and fxckpt
            # drops its captures on any `.to()`, so after `fit` there is no plan to inspect.
            segments = fxckpt.inspect(self.model).plan.segments
            self.checkpointed.append({p for s in segments for p in s.module_paths})
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.fixture
def restore_determinism() -> Iterator[None]:
    """``deterministic=True`` switches torch's deterministic algorithms on (and cuDNN's
    benchmark off) for the whole process: put them back for the tests after this one."""
    was = torch.are_deterministic_algorithms_enabled()
    benchmark = torch.backends.cudnn.benchmark
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    yield
    torch.use_deterministic_algorithms(was, warn_only=warn_only)
    torch.backends.cudnn.benchmark = benchmark
    if env is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = env


def _fit(lit: Lit, data: torch.utils.data.TensorDataset) -> None:
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
    torch.manual_seed(7)  # the same dropout masks in both runs, if capture draws nothing
    trainer.fit(lit, loader)


@pytest.mark.parametrize("where", ["__init__", "configure_model"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_lightning_trains_like_the_plain_module(case: str, where: str,
                                                restore_determinism: None) -> None:
    build, loss, data_of, strategy = CASES[case]
    model, data = build(), data_of()
    plain = Lit(copy.deepcopy(model), loss, None, strategy)
    lit = Lit(model, loss, where, strategy)
    initial = {k: v.clone() for k, v in model.state_dict().items()}

    _fit(plain, data)
    _fit(lit, data)

    # fxckpt ran, on the very model the LightningModule trained, with checkpointed blocks
    assert is_transformed(lit.model) and not is_transformed(plain.model)
    assert isinstance(lit.model, type(model)) and lit.model.__dict__ is model.__dict__
    expected = {"transformer.h.0", "transformer.h.1"} if case == "gpt2" else {"blocks.0"}
    assert len(lit.checkpointed) == STEPS and not plain.checkpointed
    for blocks in lit.checkpointed:
        assert expected <= blocks, f"{where}: segments {sorted(blocks)}"

    assert len(lit.losses) == len(plain.losses) == STEPS
    for step, (got, want) in enumerate(zip(lit.losses, plain.losses)):
        assert torch.equal(got, want), f"{where}, step {step}: loss {got} != {want}"
    trained, reference = lit.model.state_dict(), plain.model.state_dict()
    assert trained.keys() == reference.keys() == initial.keys()
    for name, value in reference.items():  # parameters and buffers (BatchNorm statistics)
        assert torch.equal(trained[name], value), f"{where}: {name} differs after {STEPS} steps"
    moved = [k for k, v in reference.items() if not torch.equal(v, initial[k])]
    assert len(moved) > len(reference) // 2, "the optimizer must have changed the weights"
