"""Python around a model's tensors that a frozen graph gets wrong, in the forms users write it.

The classes a probe of 119 hand-written models found: side effects on objects that
are not modules (counters, memory banks, logs), facts the old guards did not reach (configs
nested three deep or held in containers, ``slots`` dataclasses, callable schedules, class
attributes, module globals, closures), modules called but not registered, pruning and
parametrizations, hooks added and removed, ``functional_call`` with fast weights, a scripted
child, Python ints computed from shapes, a lazy module's dry run, attributes stored in forward
after a validation pass, ``.item()`` / ``print`` / ``logging`` in forward, dict batches with an
optional key. ``tests/dynamo/test_dynamo_facts.py`` runs each with ``capture="dynamo"`` and every
strategy against an untouched copy: outputs, every gradient, every buffer, the parameters after
SGD steps and the Python state the case names (``state``), bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from python_patterns import W, Body, Case, Tempered

log = logging.getLogger("fxckpt.tests.dynamo_patterns")


@dataclasses.dataclass(frozen=True)
class PyCase(Case):
    """A :class:`~python_patterns.Case` with the Python state its forward touches."""

    state: Optional[Callable[[nn.Module], Any]] = None
    """What to compare after every step besides tensors (a counter, a log, a bank's length)."""
    per_step: Optional[Callable[[int], tuple[tuple, dict]]] = None
    """Inputs for each step, when they change (a new batch size, a key left out)."""


# -- side effects on objects that are not modules --------------------------------------------

class Counter:
    def __init__(self) -> None:
        self.calls = 0


class HelperCounter(nn.Module):
    """A helper object counts calls; a warm-up factor is computed from the count."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.counter = Body(), Counter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.counter.calls += 1
        warmup = min(1.0, self.counter.calls / 4)
        return self.body(x) * warmup


class MemoryBank(nn.Module):
    """Features appended to a bank (a list) every call; the bank's size feeds the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.bank: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        self.bank.append(h.detach().mean(0))
        return h * (1 + len(self.bank) / 10)


class Logged(nn.Module):
    """``logging`` of a tensor's value in forward (a graph break), and a formatted record of it
    after the break. torch 2.13's Dynamo formats the float (an unspecialised input of the frame
    it resumes in) wrongly: the float itself is appended from the second call on. A known
    divergence of Dynamo's, which the harness expects (strict)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Body(depth=2), Body(depth=2)
        self.records: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        norm = h.norm().item()
        log.info("hidden norm %.4f", norm)
        self.records.append(f"{norm:.6f}")
        return self.b(h) * (1.0 if norm > 0 else 0.5)


class Printed(nn.Module):
    """A formatted record of a value read in the same statement (exact through Dynamo)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Body(depth=2), Body(depth=2)
        self.seen: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        self.seen.append(f"mean={h.mean().item():.5f}")
        return self.b(h)


class EmaOnHelper(nn.Module):
    """A helper object keeps a Python float EMA of the loss scale it is fed."""

    class Tracker:
        def __init__(self) -> None:
            self.value = 0.0

    def __init__(self) -> None:
        super().__init__()
        self.body, self.tracker = Body(), EmaOnHelper.Tracker()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        self.tracker.value = 0.9 * self.tracker.value + 0.1 * float(h.abs().mean())
        return h


# -- facts the guards must see ----------------------------------------------------------------

@dataclasses.dataclass
class Inner:
    gain: float = 1.0


@dataclasses.dataclass
class Middle:
    inner: Inner = dataclasses.field(default_factory=Inner)


@dataclasses.dataclass
class Outer:
    middle: Middle = dataclasses.field(default_factory=Middle)


class DeepConfig(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.cfg = Body(), Outer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.cfg.middle.inner.gain


class ConfigsInList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.configs = [Inner(1.0), Inner(2.0)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.configs[1].gain


class ConfigsInDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.configs = {"head": Inner(1.5)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.configs["head"].gain


@dataclasses.dataclass(slots=True)
class Slotted:
    scale: float = 1.0


class SlotsConfig(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.cfg = Body(), Slotted()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.cfg.scale


class Schedule:
    """A callable schedule object whose state the training loop advances."""

    def __init__(self) -> None:
        self.step = 0

    def __call__(self) -> float:
        return 0.5 + 0.5 * math.cos(math.pi * min(self.step, 10) / 10)


class Scheduled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.schedule = Body(), Schedule()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.schedule()


class LateAttribute(nn.Module):
    """``getattr(self, "k", None)``: an attribute set only later."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = getattr(self, "k", None)
        h = self.body(x)
        return h if k is None else h * k


class KeyAdded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.cfg: dict[str, float] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.cfg.get("scale", 1.0)


class ClassAttribute(nn.Module):
    scale = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * type(self).scale


GLOBAL_SCALE = {"value": 1.0}


class GlobalRead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * GLOBAL_SCALE["value"]


def _closure_model() -> nn.Module:
    factor = [1.0]

    class Closed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = Body()
            self.factor = factor

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x) * factor[0]

    return Closed()


# -- modules: called but not registered, pruned, parametrized, hooked -----------------------

class UnregisteredTeacher(nn.Module):
    """A teacher held in a list (not a child): its mode and dropout still matter."""

    def __init__(self) -> None:
        super().__init__()
        self.student = Body()
        teacher = nn.Sequential(nn.Linear(W, W), nn.Dropout(0.3))
        for p in teacher.parameters():
            p.requires_grad_(False)
        self.holder = [teacher]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t = self.holder[0](x)
        return self.student(x) - t


def _pruned() -> nn.Module:
    import torch.nn.utils.prune as prune

    model = nn.Sequential(nn.Linear(W, 2 * W), nn.GELU(), nn.Linear(2 * W, W), nn.GELU(),
                          nn.Linear(W, W))
    prune.l1_unstructured(model[0], "weight", amount=0.3)
    prune.random_unstructured(model[2], "weight", amount=0.2)
    return model


def _parametrized() -> nn.Module:
    from torch.nn.utils import parametrizations

    model = nn.Sequential(nn.Linear(W, W), nn.GELU(), nn.Linear(W, W), nn.GELU(),
                          nn.Linear(W, W))
    parametrizations.orthogonal(model[0])
    parametrizations.weight_norm(model[2])
    return model


class Hooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = Body(), nn.Linear(W, W)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _add_hook(model: nn.Module) -> None:
    model.head.register_forward_hook(lambda m, i, o: o * 0.5)
    model.body.blocks[0].register_forward_pre_hook(lambda m, a: (a[0] + 1.0,))


def _hooked_from_start() -> nn.Module:
    model = Hooked()
    model.handle = model.head.register_forward_hook(lambda m, i, o: o * 2.0)
    return model


def _remove_hook(model: nn.Module) -> None:
    model.handle.remove()


# -- functional_call, scripted children, shapes, lazy modules ---------------------------------

class FastWeights(nn.Module):
    """MAML's inner step: ``functional_call`` with weights one SGD step away."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Body(depth=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = dict(self.net.named_parameters())
        inner = self.net(x).square().mean()
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
        fast = {n: p - 0.1 * g for (n, p), g in zip(params.items(), grads)}
        return torch.func.functional_call(self.net, fast, (x,))


class Scripted(nn.Module):
    """A ``torch.jit.script`` child. TorchScript's executor runs a module's first calls
    (profiling) with other kernels than later ones, so the child is warmed up: both copies then
    run its optimised graph."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.act = torch.jit.script(nn.Sequential(nn.Linear(W, W), nn.Tanh()))
        for _ in range(3):  # the shapes the harness calls it with: 8 rows
            self.act(torch.randn(8, W, requires_grad=True)).sum().backward()
        self.act.zero_grad(set_to_none=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.body(x))


class Capacity(nn.Module):
    """An MoE-style capacity: a Python int computed from the batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.gate = Body(), nn.Linear(W, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        capacity = int(math.ceil(x.shape[0] * 1.25 / 4))
        h = self.body(x)
        scores = self.gate(h).softmax(-1)
        top = scores.topk(min(capacity, x.shape[0]), dim=0).values
        return h * top.mean()


class LazyHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = Body(), nn.LazyLinear(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _lazy_dry_run() -> nn.Module:
    model = LazyHead()
    model(torch.randn(2, W))  # the dry run materialises the head, as users do before training
    return model


class StoresHidden(nn.Module):
    """Keeps the last hidden state on the module (probed by a callback after each step)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = Body(), nn.Linear(W, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        self.last_hidden = h.detach()
        return self.head(h)


def _validation_pass(model: nn.Module) -> None:
    """Lightning's sanity check: a no_grad eval pass between training steps."""
    model.eval()
    with torch.no_grad():
        model(torch.randn(3, W))
    model.train()


class DictBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.aux = Body(), nn.Linear(W, W)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h = self.body(batch["x"])
        if "mask" in batch:
            h = h * batch["mask"]
        return h


def _dict_batch(mask: bool) -> Callable[[], tuple[tuple, dict]]:
    def make() -> tuple[tuple, dict]:
        batch = {"x": torch.randn(8, W, requires_grad=True)}
        if mask:
            batch["mask"] = (torch.rand(8, W) > 0.2).float()
        return (batch,), {}
    return make


def _set(path: str, value: Any) -> Callable[[nn.Module], None]:
    def change(model: nn.Module) -> None:
        owner, _, name = path.rpartition(".")
        target: Any = model
        for part in owner.split(".") if owner else []:
            target = target[int(part)] if part.isdigit() else getattr(target, part)
        setattr(target, name, value)
    return change


def _global(value: float) -> Callable[[nn.Module], None]:
    return lambda model: GLOBAL_SCALE.__setitem__("value", value)


def _class_attr(model: nn.Module) -> None:
    type(model).scale = 0.25


def _advance(model: nn.Module) -> None:
    model.schedule.step += 3


DYNAMO_CASES = [
    PyCase("helper_object_counter", HelperCounter, state=lambda m: m.counter.calls),
    PyCase("memory_bank_appended", MemoryBank, state=lambda m: len(m.bank)),
    PyCase("logging_a_tensor_value", Logged, state=lambda m: list(m.records)),
    PyCase("formatted_record_with_item", Printed, state=lambda m: list(m.seen)),
    PyCase("ema_float_on_helper", EmaOnHelper, state=lambda m: m.tracker.value),
    PyCase("config_three_levels_deep", DeepConfig, between=_set("cfg.middle.inner.gain", 3.0)),
    PyCase("config_in_a_list", ConfigsInList, between=_set("configs.1.gain", 0.5)),
    PyCase("config_in_a_dict", ConfigsInDict,
           between=lambda m: setattr(m.configs["head"], "gain", 4.0)),
    PyCase("slots_dataclass", SlotsConfig, between=_set("cfg.scale", 0.1)),
    PyCase("callable_schedule", Scheduled, between=_advance),
    PyCase("attribute_set_later", LateAttribute, between=_set("k", 2.0)),
    PyCase("key_added_to_config", KeyAdded,
           between=lambda m: m.cfg.__setitem__("scale", 0.3)),
    PyCase("class_attribute_changed", ClassAttribute, between=_class_attr),
    PyCase("module_global_changed", GlobalRead, between=_global(0.2)),
    PyCase("closure_changed", _closure_model, between=lambda m: m.factor.__setitem__(0, 5.0)),
    PyCase("float_schedule_every_step", Tempered, between=_set("temperature", 0.7),
           steps=4),
    PyCase("teacher_in_a_list_mode_changed", UnregisteredTeacher,
           between=lambda m: m.holder[0].eval()),
    PyCase("pruned_linears", _pruned, depth=1),
    PyCase("parametrized_orthogonal_and_weight_norm", _parametrized, depth=1),
    PyCase("hooks_added_after_first_step", Hooked, between=_add_hook),
    PyCase("hook_removed_after_first_step", _hooked_from_start, between=_remove_hook),
    PyCase("functional_call_fast_weights", FastWeights),
    PyCase("scripted_child", Scripted),
    PyCase("capacity_from_batch_size", Capacity,
           per_step=lambda step: ((torch.randn((8, 12, 5)[step], W, requires_grad=True),), {})),
    PyCase("lazy_module_after_dry_run", _lazy_dry_run),
    PyCase("hidden_stored_after_validation_pass", StoresHidden, between=_validation_pass,
           attributes=("last_hidden",)),
    PyCase("dict_batch_with_mask", DictBatch, inputs=_dict_batch(True)),
    PyCase("dict_batch_optional_key", DictBatch,
           per_step=lambda step: _dict_batch(step != 1)()),
]
"""Every case: ``tests/dynamo/test_dynamo_facts.py`` runs each on ``capture="dynamo"``."""
