"""Guards: what a captured graph depends on is recorded at capture and checked every call
(fxckpt/capture/guards.py), and a changed fact captures again (fxckpt/serve/dispatch.py)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn

import fxckpt
from fxckpt.serve.dispatch import RECAPTURE_WARNING
from fxckpt.errors import CaptureError
from fxckpt.capture.guards import build_guards
from fxckpt.capture.reads import recording
from patterns import Stack, Tempered
from support import assert_steps_equal, loss_of, run_step


class Reader(nn.Module):
    kind = "class default"

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = 0.5
        self.sizes = [1, 2]
        self.act = torch.tanh
        self.unread = 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.kind == "class default"
        return self.act(self.fc(x)) * self.scale * len(self.sizes)


def _guarded(model: nn.Module) -> object:
    with recording(list(model.modules())) as reads:
        model(torch.randn(2, 4))
    return build_guards(model, reads)


def test_reads_are_recorded_and_unread_attributes_are_not_guarded() -> None:
    model = Reader()
    guards = _guarded(model)
    assert type(model) is Reader  # the recording subclass is gone again
    assert guards.failure() is None
    model.unread = 4
    assert guards.failure() is None  # never read: changing it captures nothing again
    for change, fact in [
        (lambda m: setattr(m, "scale", 2.0), "attributes of <root>: `scale`"),
        (lambda m: setattr(m, "scale", 1), "attributes of <root>: `scale`"),  # 1 != 1.0's type
        (lambda m: m.sizes.append(3), "attributes of <root>: `sizes`"),  # changed in place
        (lambda m: setattr(m, "act", torch.relu), "attributes of <root>: `act`"),
        (lambda m: setattr(m, "kind", "instance"), "attributes of <root>: `kind`"),
        (lambda m: setattr(m, "fc", nn.Linear(4, 4)), "the children of <root>"),
        (lambda m: setattr(m.fc, "weight", nn.Parameter(torch.ones(4, 4))),
         "the parameters of fc"),
        (lambda m: m.register_buffer("extra", torch.ones(1)), "the buffers of <root>"),
    ]:
        model = Reader()
        guards = _guarded(model)
        change(model)
        failure = guards.failure()
        assert failure is not None and failure.fact == fact, (fact, failure)


def test_negative_zero_is_a_change() -> None:
    model = Reader()
    model.scale = 0.0
    guards = _guarded(model)
    model.scale = -0.0
    failure = guards.failure()
    assert failure is not None and "was 0.0, now -0.0" in failure.detail


def test_a_read_numpy_generator_is_refused() -> None:
    np = pytest.importorskip("numpy")
    model = Reader()
    model.rng = np.random.default_rng(0)
    with recording([model]) as reads:
        _ = model.rng
    with pytest.raises(CaptureError, match=r"reads `<root>.rng`, a numpy.random._generator"):
        build_guards(model, reads)


def test_a_changed_fact_captures_again_and_an_unchanged_one_reuses(
        caplog: pytest.LogCaptureFixture) -> None:
    model = Tempered()
    reference = copy.deepcopy(model)
    tm = fxckpt.transform(model, every=1, capture="graph")
    x = torch.randn(4, 16)
    caplog.set_level(logging.INFO, logger="fxckpt.serve.dispatch")
    for temperature, captures in [(1.0, 1), (1.0, 1), (2.0, 2), (1.0, 2)]:
        model.temperature = reference.temperature = temperature
        assert_steps_equal(run_step(tm, (x,), {}), run_step(reference, (x,), {}))
        assert fxckpt.inspect(tm).captures == captures
    assert "attributes of <root>: `temperature` changed (was 1.0, now 2.0); capturing again" \
        in caplog.text


def test_a_fact_changing_every_step_warns_once_with_the_fix(
        caplog: pytest.LogCaptureFixture) -> None:
    tm = fxckpt.transform(Tempered(), every=1, capture="graph")
    x = torch.randn(4, 16)
    for step in range(RECAPTURE_WARNING + 3):
        tm.temperature = 1.0 + step
        loss_of(tm(x)).backward()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "`temperature` of Tempered has changed 3 times" in warnings[0].getMessage()
    assert "register_buffer" in warnings[0].getMessage()


def test_a_replaced_child_drops_the_capture_that_called_the_old_one() -> None:
    model = Tempered()
    tm = fxckpt.transform(model, every=1, capture="graph")
    x = torch.randn(4, 16)
    tm(x)
    old = model.body
    model.body = Stack()
    tm(x)
    entries = [e for es in fxckpt.module.dispatcher_of(tm).entries.values() for e in es]
    assert len(entries) == 1  # the old graph (and the old child it holds) is gone
    assert all(m is not old for m in entries[0].captured.gm.modules())



class _Options:
    def __init__(self) -> None:
        self.scale = 2.0


class _Configured(nn.Module):
    """A dict of config objects read by forward (PEFT's ``LoraModel.peft_config``), in a model
    only torch.export captures (a Python loop over the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.opts = {"default": _Options()}
        self.names = ["fc"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = [self.fc(x[i]) for i in range(x.shape[0])]
        return torch.relu(torch.stack(rows)) * self.opts["default"].scale * len(self.names)


def test_an_export_leaves_the_models_own_dicts_and_lists_in_place() -> None:
    """torch.export puts back rebuilt copies of every dict and list attribute; fxckpt puts the
    model's own objects back, so identity guards hold and nothing is captured again."""
    net = nn.Sequential(_Configured())
    opts, names = net[0].opts, net[0].names
    tm = fxckpt.transform(net, every=1, capture="graph")
    for _ in range(3):
        tm(torch.randn(4, 8)).sum().backward()
    assert net[0].opts is opts and net[0].names is names
    assert fxckpt.inspect(tm).captures == 1
