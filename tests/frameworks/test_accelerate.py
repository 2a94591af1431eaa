"""fxckpt under Hugging Face ``accelerate``: ``accelerator.prepare`` the transformed model, step
with ``accelerator.backward``, on one CPU process and with DDP on two gloo processes.

Each loop is compared with the same loop on an untouched copy of the model (same seed, same
data): every loss and every final parameter the same bits. fxckpt's recompute is exact on CPU,
and under DDP both runs all-reduce the same gradients (a sum of two ranks' values is the same
in any bucket order). The DDP run accumulates gradients over two micro-batches with
``accelerator.accumulate(model)``, so every other backward runs under DDP's ``no_sync``: with
reentrant checkpointing that path marks parameters ready twice (peft #313, accelerate #2017).
"""

from __future__ import annotations

import copy
import os
from typing import Any, Iterator

import pytest
import torch

import fxckpt
import tiny
import gloo

pytestmark = pytest.mark.frameworks

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

SEQ = 16
STEPS = 3


_model = tiny.llama


def _reset() -> None:
    """accelerate keeps its state in process-wide singletons; each loop starts afresh."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate_state() -> Iterator[None]:
    _reset()
    yield
    _reset()


class Loop:
    """``STEPS`` AdamW steps through an Accelerator; what each micro-batch saw."""

    def __init__(self, model: torch.nn.Module, accumulate: int = 1, **ddp: Any) -> None:
        _reset()
        handlers = [accelerate.DistributedDataParallelKwargs(**ddp)] if ddp else []
        self.accelerator = accelerate.Accelerator(
            cpu=True, gradient_accumulation_steps=accumulate, kwargs_handlers=handlers)
        acc = self.accelerator
        g = torch.Generator().manual_seed(1)
        rows = STEPS * accumulate * acc.num_processes * 2
        data = torch.utils.data.TensorDataset(torch.randint(0, 128, (rows, SEQ), generator=g))
        loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.model, opt, loader = acc.prepare(model, opt, loader)
        self.losses: list[torch.Tensor] = []
        self.synced: list[bool] = []
        for (ids,) in loader:
            with acc.accumulate(self.model):
                loss = self.model(input_ids=ids, labels=ids).loss
                acc.backward(loss)
                self.synced.append(acc.sync_gradients)
                opt.step()
                opt.zero_grad()
            self.losses.append(loss.detach())
        self.params = {n: p.detach().clone()
                       for n, p in acc.unwrap_model(self.model).named_parameters()}


def _assert_same_run(got: Loop, expected: Loop) -> None:
    assert len(got.losses) == len(expected.losses) > 0
    for step, (a, b) in enumerate(zip(got.losses, expected.losses)):
        assert torch.equal(a, b), f"loss of micro-batch {step}: {a.item()} vs {b.item()}"
    assert got.synced == expected.synced
    assert list(got.params) == list(expected.params)
    different = [n for n, p in expected.params.items() if not torch.equal(got.params[n], p)]
    assert not different, f"parameters differ: {different}"


def _assert_planned(tm: torch.nn.Module) -> None:
    assert fxckpt.inspect(tm).plan.segments, "fxckpt planned no checkpointed segment"


def test_an_accelerator_trains_the_transformed_model_like_the_model() -> None:
    model = _model()
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, budget=0.5)
    got = Loop(tm)
    assert got.model is tm  # one process: prepare hands the module back as it is
    expected = Loop(reference)
    assert len(got.losses) == STEPS and got.synced == [True] * STEPS
    _assert_same_run(got, expected)
    _assert_planned(tm)
    start = _model()
    assert any(not torch.equal(p, q) for p, q in zip(tm.parameters(), start.parameters()))


# --- DDP on two gloo processes ------------------------------------------------------------------


def _ddp(rank: int, world: int) -> None:
    # what a launcher (accelerate launch, torchrun) sets; gloo.run has set MASTER_ADDR / PORT
    # and joined the process group, which accelerate uses as it finds it
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    model = _model()
    plain = Loop(copy.deepcopy(model), accumulate=2)
    acc = plain.accelerator
    assert acc.distributed_type == accelerate.DistributedType.MULTI_CPU
    assert acc.num_processes == world and acc.process_index == rank
    assert isinstance(plain.model, torch.nn.parallel.DistributedDataParallel)
    # gradients accumulate over 2 micro-batches: the first runs under no_sync
    assert plain.synced == [False, True] * STEPS
    for ddp in ({}, {"find_unused_parameters": True}):
        tm = fxckpt.transform(copy.deepcopy(model), budget=0.5)
        got = Loop(tm, accumulate=2, **ddp)
        assert isinstance(got.model, torch.nn.parallel.DistributedDataParallel)
        assert got.model.module is tm
        _assert_same_run(got, plain)
        _assert_planned(tm)
    # the ranks trained on different halves of the data and ended on the same parameters
    first = torch.cat([p.flatten() for p in plain.params.values()])
    both = [torch.empty_like(first) for _ in range(world)]
    torch.distributed.all_gather(both, first)
    assert torch.equal(both[0], both[1])
    losses = [torch.empty(len(plain.losses)) for _ in range(world)]
    torch.distributed.all_gather(losses, torch.stack(plain.losses))
    assert not torch.equal(losses[0], losses[1])


@pytest.mark.slow
def test_ddp_through_accelerate_with_gradient_accumulation_matches_ddp_without_fxckpt() -> None:
    gloo.run(_ddp)
