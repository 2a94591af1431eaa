"""fxckpt inside the Hugging Face ``Trainer``, with the arguments users leave at their defaults.

The Trainer reads ``inspect.signature(model.forward)`` to drop dataset columns the model does not
take (``remove_unused_columns=True``): a transformed module whose forward read ``(*args,
**kwargs)`` had every column dropped ("The batch received was empty"). Each run here is compared
with the same Trainer run on an untouched copy of the model: the logged losses and the final
parameters must be the same bits (fxckpt's recompute is exact on CPU, and nothing else differs).
Saving, reloading and resuming from a Trainer checkpoint go through ``save_pretrained`` /
``load_state_dict`` on the transformed module, which must look like the model's own.

``TrainingArguments(gradient_checkpointing=True)`` and ``model.gradient_checkpointing_enable()``
ask the model's layers to checkpoint themselves through ``torch.utils.checkpoint``; under fxckpt
that would recompute twice, so fxckpt keeps the layers' own checkpointing off and says so once.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import fxckpt
import tiny

pytestmark = [
    pytest.mark.frameworks,
    # transformers 5 renames gradient_checkpointing* to activation_checkpointing* (old names kept
    # until v6); users still write the old ones, which work with transformers 4 too
    pytest.mark.filterwarnings("ignore:.*will be removed in v6:FutureWarning"),
]

transformers = pytest.importorskip("transformers")

SEQ = 16
COLUMNS = {"input_ids", "attention_mask", "labels"}  # what the Trainer hands the model


_model = tiny.llama


def _rows(n: int = 16) -> list[dict[str, Any]]:
    """A dataset as a plain list of dicts, with two columns the model does not take."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(n):
        ids = torch.randint(0, 128, (SEQ,), generator=g)
        mask = torch.ones(SEQ, dtype=torch.long)
        mask[: i % 4] = 0  # some left padding, so the mask matters
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.clone(),
                     "text": f"row {i}", "idx": i})
    return rows


def _args(out: Path, **more: Any) -> Any:
    options: dict[str, Any] = dict(save_strategy="no")
    options.update(more)
    return transformers.TrainingArguments(
        output_dir=str(out), max_steps=3, per_device_train_batch_size=4, seed=0,
        report_to="none", use_cpu=True, logging_steps=1, disable_tqdm=True, **options,
    )


def _trainer(model: torch.nn.Module, out: Path, **more: Any) -> Any:
    return transformers.Trainer(model=model, args=_args(out, **more), train_dataset=_rows())


def _losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_same_params(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    different = [n for n in expected if not torch.equal(got[n], expected[n])]
    assert not different, f"parameters differ: {different}"


def _record_columns(model: torch.nn.Module) -> list[set[str]]:
    """The keyword names of every call of ``model``, as a forward pre-hook sees them."""
    seen: list[set[str]] = []

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        seen.append(set(kwargs))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def _segments(tm: torch.nn.Module) -> int:
    return len(fxckpt.inspect(tm).plan.segments)


class Runs:
    """The plain run and the fxckpt run (which also saves a checkpoint at step 2)."""

    def __init__(self, root: Path) -> None:
        self.plain = _trainer(_model(), root / "plain")
        self.plain.train()
        model = _model()
        self.tm = fxckpt.transform(model, budget=0.5)
        self.columns = _record_columns(self.tm)
        self.trainer = _trainer(self.tm, root / "fxckpt", save_strategy="steps", save_steps=2)
        self.trainer.train()
        self.root = root


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("trainer"))


def test_the_trainer_with_default_arguments_trains_the_transformed_model_like_the_model(
    runs: Runs,
) -> None:
    assert inspect.signature(runs.tm.forward) == inspect.signature(_model().forward)
    # the column filter kept what the model takes and dropped "text" and "idx" (the Trainer adds
    # num_items_in_batch for models whose forward takes **kwargs, as Llama's does)
    assert len(runs.columns) == 3, runs.columns
    assert all(keys - {"num_items_in_batch"} == COLUMNS for keys in runs.columns), runs.columns
    assert _segments(runs.tm) > 0, "fxckpt planned no checkpointed segment"
    plain = _losses(runs.plain)
    assert len(plain) == 3 and _losses(runs.trainer) == plain
    assert [h.get("grad_norm") for h in runs.trainer.state.log_history] == [
        h.get("grad_norm") for h in runs.plain.state.log_history
    ]
    _assert_same_params(_params(runs.tm), _params(runs.plain.model))
    assert runs.trainer.state.global_step == 3
    start = _params(_model())
    assert any(not torch.equal(p, start[n]) for n, p in _params(runs.tm).items())  # it trained


def test_a_saved_transformed_model_reloads_as_the_model(runs: Runs) -> None:
    for where, save in [
        (runs.root / "save_model", lambda d: runs.trainer.save_model(str(d))),
        (runs.root / "save_pretrained", lambda d: runs.tm.save_pretrained(str(d))),
    ]:
        save(where)
        config = json.loads((where / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"], where
        loaded = transformers.LlamaForCausalLM.from_pretrained(str(where))
        assert type(loaded) is transformers.LlamaForCausalLM
        _assert_same_params(_params(loaded), _params(runs.tm))


def test_resuming_from_a_trainer_checkpoint_ends_where_the_uninterrupted_run_ends(
    runs: Runs, tmp_path: Path,
) -> None:
    checkpoint = runs.root / "fxckpt" / "checkpoint-2"
    assert (checkpoint / "model.safetensors").exists()
    tm = fxckpt.transform(_model(), budget=0.5)
    resumed = _trainer(tm, tmp_path, save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 3
    # steps 1 and 2 come from the checkpoint's trainer_state.json, step 3 from the resumed run
    assert _losses(resumed) == _losses(runs.plain)
    assert _segments(tm) > 0
    _assert_same_params(_params(tm), _params(runs.plain.model))


# --- the model's own gradient checkpointing -----------------------------------------------------


@pytest.fixture
def hf_checkpoint_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls of the function Hugging Face layers checkpoint themselves through (it
    wraps ``transformers.modeling_utils.checkpoint`` when checkpointing is enabled)."""
    calls = [0]
    real = transformers.modeling_utils.checkpoint

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "checkpoint", counting)
    return calls


def test_the_counter_sees_hugging_faces_own_checkpointing(hf_checkpoint_calls: list[int]) -> None:
    """Without fxckpt the layers do checkpoint through the counted function: a zero count below
    means they did not."""
    model = _model().train()
    model.gradient_checkpointing_enable()
    ids = torch.randint(0, 128, (2, SEQ))
    model(input_ids=ids, labels=ids).loss.backward()
    assert hf_checkpoint_calls[0] == 2  # one per decoder layer


def _own_checkpointing(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False)]


def _fxckpt_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "fxckpt" and r.levelno == logging.WARNING]


def _assert_left_to_fxckpt(tm: torch.nn.Module, calls: list[int]) -> None:
    assert not tm.is_gradient_checkpointing
    assert not _own_checkpointing(tm)
    assert calls[0] == 0, "the model's layers checkpointed themselves under fxckpt"
    assert _segments(tm) > 0, "fxckpt planned no checkpointed segment"


def test_trainer_gradient_checkpointing_is_left_to_fxckpt(
    runs: Runs, tmp_path: Path, caplog: pytest.LogCaptureFixture,
    hf_checkpoint_calls: list[int],
) -> None:
    tm = fxckpt.transform(_model(), budget=0.5)
    caplog.set_level(logging.WARNING, logger="fxckpt")
    trainer = _trainer(tm, tmp_path, gradient_checkpointing=True)
    trainer.train()
    said = _fxckpt_warnings(caplog)
    assert len(said) == 1, said
    # the Trainer calls activation_checkpointing_enable (transformers 5), or the old name (4.x)
    assert "fxckpt" in said[0] and any(f"{name}_checkpointing_enable" in said[0]
                                       for name in ("gradient", "activation")), said
    _assert_left_to_fxckpt(tm, hf_checkpoint_calls)
    assert _losses(trainer) == _losses(runs.plain)
    _assert_same_params(_params(tm), _params(runs.plain.model))


def test_gradient_checkpointing_enable_on_the_transformed_model_is_declined(
    caplog: pytest.LogCaptureFixture, hf_checkpoint_calls: list[int],
) -> None:
    model = _model().train()
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, depth=3)
    caplog.set_level(logging.WARNING, logger="fxckpt")
    tm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    said = _fxckpt_warnings(caplog)
    assert len(said) == 1 and "gradient_checkpointing_enable" in said[0], said
    if hasattr(tm, "activation_checkpointing_enable"):  # transformers 5's name (the Trainer's)
        tm.activation_checkpointing_enable()
        assert len(_fxckpt_warnings(caplog)) == 2
    ids = torch.randint(0, 128, (4, SEQ))
    for m in (tm, reference):
        m(input_ids=ids, labels=ids).loss.backward()
    _assert_left_to_fxckpt(tm, hf_checkpoint_calls)
    for (name, p), q in zip(tm.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), f"grad of {name} differs"


def test_checkpointing_enabled_before_transform_is_turned_off_by_it(
    runs: Runs, tmp_path: Path, caplog: pytest.LogCaptureFixture,
    hf_checkpoint_calls: list[int],
) -> None:
    model = _model()
    model.gradient_checkpointing_enable()
    assert model.is_gradient_checkpointing and _own_checkpointing(model)
    caplog.set_level(logging.WARNING, logger="fxckpt")
    tm = fxckpt.transform(model, budget=0.5)
    said = _fxckpt_warnings(caplog)
    assert len(said) == 1, said
    assert "fxckpt" in said[0] and "checkpointing" in said[0]
    assert not model.is_gradient_checkpointing  # the model's own, turned off at transform
    trainer = _trainer(tm, tmp_path)
    trainer.train()
    _assert_left_to_fxckpt(tm, hf_checkpoint_calls)
    assert _losses(trainer) == _losses(runs.plain)
    _assert_same_params(_params(tm), _params(runs.plain.model))
