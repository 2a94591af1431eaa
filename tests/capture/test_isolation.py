"""Captures beside other threads: serialised, unseen by other threads, never rewinding their
random numbers, and nothing left patched afterwards (fxckpt/capture/isolation.py)."""

from __future__ import annotations

import copy
import random
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn as nn

import fxckpt
from patterns import Stack
from support import loss_of


def _patched_names() -> dict[str, object]:
    """Everything a capture may replace for a while, as it is now."""
    names: dict[str, object] = {
        "Module.__call__": nn.Module.__call__,
        "Module.__getattr__": nn.Module.__getattr__,
        "Function.apply": torch.autograd.Function.__dict__["apply"],
        "fx._new_patcher": torch.fx._symbolic_trace._new_patcher,
    }
    names.update({f"random.{n}": getattr(random, n) for n in dir(random) if not n.startswith("_")})
    names.update({f"np.random.{n}": getattr(np.random, n) for n in dir(np.random)
                  if not n.startswith("_")})
    return names


class Worker(threading.Thread):
    """Trains an untransformed model, and draws augmentation numbers, until told to stop."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        torch.manual_seed(7)
        self.model = Stack()
        self.stop = threading.Event()
        self.steps = 0
        self.errors: list[BaseException] = []
        self.draws: list[float] = []
        self.outputs_ok = True

    def run(self) -> None:
        x = torch.randn(4, 16)
        try:
            while not self.stop.is_set():
                out = self.model(x)
                self.outputs_ok &= type(out) is torch.Tensor
                loss_of(out).backward()
                self.draws.append(random.random())
                self.steps += 1
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.errors.append(e)


@pytest.mark.parametrize("capture", ["symbolic_trace", "export"])
def test_capture_is_invisible_to_a_thread_training_beside_it(capture: str) -> None:
    before = _patched_names()
    worker = Worker()
    worker.start()
    try:
        while worker.steps < 3:
            time.sleep(0.001)
        for _ in range(3):  # several captures while the worker trains
            tm = fxckpt.transform(Stack(), every=1, capture=capture)
            loss_of(tm(torch.randn(4, 16))).backward()
        done = worker.steps
        while worker.steps < done + 3:
            time.sleep(0.001)
    finally:
        worker.stop.set()
        worker.join(timeout=30)
    assert not worker.errors, worker.errors
    assert worker.outputs_ok  # never a torch.fx.Proxy
    assert len(set(worker.draws)) == len(worker.draws)  # no random number handed out twice
    assert _patched_names() == before  # nothing left patched


def test_captures_run_one_at_a_time() -> None:
    from fxckpt.capture import isolation

    inside: list[int] = []
    most = [0]
    original = isolation.isolated

    import contextlib

    @contextlib.contextmanager
    def counting():  # type: ignore[no-untyped-def]
        with original():
            inside.append(1)
            most[0] = max(most[0], len(inside))
            time.sleep(0.01)
            yield
            inside.pop()

    import importlib

    capture_module = importlib.import_module("fxckpt.capture.captured")

    capture_module.isolated = counting  # type: ignore[attr-defined]
    stance = _stance()
    try:
        threads = [threading.Thread(target=lambda: fxckpt.transform(
            Stack(), every=1, example_inputs=(torch.randn(4, 16),))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        capture_module.isolated = original  # type: ignore[attr-defined]
    assert most[0] == 1
    assert _stance() == stance == "default"  # no thread put back another's "force_eager"


def test_a_capture_leaves_the_random_states_as_an_eager_step_does() -> None:
    """The first training step (capture, plan, run) draws what the model's own step draws."""
    torch.manual_seed(0)
    model = Stack()
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda mod, i, o: nn.functional.dropout(o, 0.2))
    x = torch.randn(4, 16)
    states = []
    for module in (model, fxckpt.transform(model, budget=0.9, offload="auto",
                                           offload_device="cpu")):
        torch.manual_seed(3)
        random.seed(3)
        np.random.seed(3)
        loss_of(module(x)).backward()
        states.append((torch.get_rng_state(), random.getstate(), np.random.get_state()[1]))
    (t1, r1, n1), (t2, r2, n2) = states
    assert torch.equal(t1, t2) and r1 == r2 and np.array_equal(n1, n2)


def _process_state() -> dict[str, object]:
    """Everything process- or thread-wide a transform and a step could leave changed."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    state = dict(_patched_names())
    state.update({
        "grad": torch.is_grad_enabled(),
        "autocast": tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                          for d in ("cpu", "cuda")),
        "autocast cache": torch.is_autocast_cache_enabled(),
        "default dtype": torch.get_default_dtype(),
        "function modes": len(_get_current_function_mode_stack()),
        "dispatch modes": len(_get_current_dispatch_mode_stack()),
        "global hooks": tuple(len(t) for t in (
            nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks,
            nn.modules.module._global_backward_hooks,
            nn.modules.module._global_backward_pre_hooks)),
        "fx tracing": torch.fx._symbolic_trace._is_fx_tracing_flag,
        "compile stance": _stance(),
        "fx patcher": torch.fx._symbolic_trace.CURRENT_PATCHER,
    })
    return state


def _stance() -> str:
    """torch.compile's stance (process-wide: fxckpt plans under "force_eager")."""
    return str(torch._dynamo.eval_frame._stance.stance)


def _random_states() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()[1]


class Stateful(nn.Module):
    """no_grad and autocast islands, noise, an attribute read: every kind of fact."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Stack()
        self.scale = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        with torch.no_grad():
            t = h.tanh()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            u = h @ h.transpose(0, 1)
        return (h * t + u.float().mean()) * self.scale + torch.randn(h.shape[-1])


@pytest.mark.parametrize("capture", ["symbolic_trace", "export"])
@pytest.mark.parametrize("options", [{"every": 1}, {"budget": 0.9},
                                     {"budget": 0.9, "offload": "auto",
                                      "offload_device": "cpu"}])
def test_transform_and_a_step_change_no_process_state(options: dict, capture: str) -> None:
    before = _process_state()
    torch.manual_seed(0)
    model = Stateful()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 16)
    drawn = []
    for module in (reference, fxckpt.transform(model, capture=capture, **options)):
        torch.manual_seed(5)
        random.seed(5)
        np.random.seed(5)
        loss_of(module(x)).backward()
        drawn.append(_random_states())
    assert _process_state() == before
    (t1, c1, r1, n1), (t2, c2, r2, n2) = drawn
    assert torch.equal(t1, t2) and all(map(torch.equal, c1, c2))
    assert r1 == r2 and np.array_equal(n1, n2)


def test_a_refused_capture_changes_no_process_state() -> None:
    class LeavesGradOff(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch.set_grad_enabled(False)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.fc(x)

    before = _process_state()
    with pytest.raises(fxckpt.CaptureError, match="leaves them so when it returns"):
        fxckpt.transform(LeavesGradOff(), every=1, capture="graph")(torch.randn(2, 4))
    assert _process_state() == before
