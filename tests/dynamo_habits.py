"""More forms of the classes in ``tests/dynamo_patterns.py``, as training code writes them.

Each class the user probe found has several forms; these are the ones the first list
does not hold: Python state on helpers (a stats dict, a history of floats, a MoCo queue pointer,
a printed log), facts read through Python idioms (a ``namedtuple`` replaced, a ``property``
derived from another field, an ``Enum`` mode, a ``functools.partial`` activation, a plain tensor
attribute, a float keyword per step, a slice of layers that grows), state users change between
steps (a frozen block, ``load_state_dict(assign=True)``, BatchNorm put in eval alone, a
pre-hook with keyword arguments), data-dependent Python (an ``.item()`` branch, a generator the
model owns, a scripted function), the model's own ``torch.utils.checkpoint`` calls on a data
batch (reentrant, by default, non-reentrant, and with an input that requires grad), hooks the
forward registers on tensors it computes. ``tests/dynamo/test_dynamo_facts.py`` runs them with
the first list, every strategy, bit for bit.
"""

from __future__ import annotations

import collections
import enum
import functools
import io
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt

from dynamo_patterns import PyCase
from python_patterns import W, Body


# -- Python state on helpers ------------------------------------------------------------------

class StatsDict(nn.Module):
    """A dict of running statistics and a history of floats, as a logger callback keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.stats: dict[str, int] = {"rows": 0, "calls": 0}
        self.history: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.stats["rows"] += x.shape[0]
        self.stats["calls"] += 1
        h = self.body(x)
        self.history.append(float(h.detach().abs().mean()))
        return h


class MocoQueue(nn.Module):
    """MoCo's key queue: a buffer written under no_grad at a Python-int pointer."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.key = Body(), nn.Linear(W, W)
        self.register_buffer("queue", torch.zeros(32, W))
        self.ptr = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.body(x)
        with torch.no_grad():
            k = F.normalize(self.key(x), dim=-1)
            n = k.shape[0]
            self.queue[self.ptr:self.ptr + n] = k
            self.ptr = (self.ptr + n) % self.queue.shape[0]
        return q @ self.queue.t()


class PrintsToLog(nn.Module):
    """``print`` of a tensor and of the call number, to a stream the trainer keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.out = io.StringIO()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.body(x)
        print("call", self.calls, h[0, :2].detach(), file=self.out)
        return h


# -- facts read through Python idioms ---------------------------------------------------------

Settings = collections.namedtuple("Settings", ["scale", "shift"])


class NamedTupleConfig(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.cfg = Body(), Settings(1.0, 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.cfg.scale + self.cfg.shift


class Derived:
    def __init__(self) -> None:
        self.base = 2.0

    @property
    def gain(self) -> float:
        return self.base / 4


class PropertyConfig(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.cfg = Body(), Derived()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.cfg.gain


class Mode(enum.Enum):
    PLAIN = "plain"
    GATED = "gated"


class EnumMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.gate = Body(), nn.Linear(W, W)
        self.mode = Mode.PLAIN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if self.mode is Mode.GATED:
            h = h * torch.sigmoid(self.gate(h))
        return h


class PartialActivation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = Body(), nn.Linear(W, W)
        self.act = functools.partial(F.leaky_relu, negative_slope=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.body(x)))


class TensorAttribute(nn.Module):
    """A plain tensor attribute (not a buffer), replaced by the loop."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.weights = torch.linspace(0.5, 1.5, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.weights


class ScaledCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()

    def forward(self, x: torch.Tensor, scale: float = 1.0, clip: bool = False) -> torch.Tensor:
        h = self.body(x) * scale
        return h.clamp(-0.5, 0.5) if clip else h


class Growing(nn.Module):
    """Progressive growing: the loop raises how many blocks the forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body(depth=4)
        self.active = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.body.blocks[: self.active]:
            x = x + block(x)
        return x


# -- state the loop changes between steps -----------------------------------------------------

def _freeze_first_block(model: nn.Module) -> None:
    model.blocks[0].requires_grad_(False)


def _assign_state(model: nn.Module) -> None:
    torch.manual_seed(21)  # both models get the same new tensors
    state = {k: torch.randn_like(v) * 0.1 for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)


class WithNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.norm, self.head = Body(), nn.BatchNorm1d(W), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x)))


def _freeze_norm(model: nn.Module) -> None:
    model.norm.eval()  # fine-tuning habit: statistics frozen, the rest trains


def _kwargs_pre_hook(model: nn.Module) -> None:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return (args[0] * 0.5,), kwargs
    model.head.register_forward_pre_hook(hook, with_kwargs=True)


# -- data-dependent Python --------------------------------------------------------------------

class ItemBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.a, self.b = Body(), nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if h.mean().item() > 0:
            return self.a(h)
        return self.b(h).tanh()


class OwnGenerator(nn.Module):
    """Noise from a generator the model owns (seeded once), as augmentation code holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.gen = torch.Generator().manual_seed(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.randn(x.shape, generator=self.gen)
        return self.body(x + 0.01 * noise)


@torch.jit.script
def _scripted_gate(h: torch.Tensor, t: float) -> torch.Tensor:
    return h * torch.sigmoid(h / t)


class ScriptedFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _scripted_gate(self.body(x), 2.0)


class DataCheckpointed(nn.Module):
    """Blocks the forward checkpoints itself, called on a data batch (no grad): with
    ``use_reentrant=True`` (torch's default, with a warning) eager gives the first call's
    parameters no gradient at all (torch warns that none of its inputs requires grad)."""

    def __init__(self, reentrant: Optional[bool], at_root: bool = False) -> None:
        super().__init__()
        self.body, self.head = Body(), nn.Linear(W, W)
        self.reentrant, self.at_root = reentrant, at_root

    def _ckpt(self, fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:  # torch warns: "the use_reentrant parameter should be passed"
            return ckpt.checkpoint(fn, *args)
        return ckpt.checkpoint(fn, *args, use_reentrant=self.reentrant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.at_root:
            return self.head(self._ckpt(self.body, x))
        for block in self.body.blocks:
            x = x + self._ckpt(block, x)
        return self.head(x)


class MixedCheckpointInputs(DataCheckpointed):
    """A reentrant call whose first input is data and whose second requires grad (an
    embedding): eager's reentrant checkpoint differentiates through it."""

    def __init__(self) -> None:
        super().__init__(True)
        self.pos = nn.Parameter(torch.randn(W) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def block(h: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
            return self.body.blocks[0](h + p)
        return self.head(ckpt.checkpoint(block, x, self.pos * 2, use_reentrant=True))


class GradHalved(nn.Module):
    """A hook on an intermediate tensor scales its gradient (gradient scaling by hand)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body(depth=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.body.blocks):
            x = x + block(x)
            if i == 1:
                x.register_hook(lambda g: g * 0.5)
        return x


class GradNormsLogged(GradHalved):
    """A hook logs the gradient norm reaching a hidden state (a common debugging habit)."""

    def __init__(self) -> None:
        super().__init__()
        self.norms: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.body.blocks):
            x = x + block(x)
            if i == 2 and x.requires_grad:
                x.register_hook(lambda g: self.norms.append(round(g.norm().item(), 6)))
        return x


class HookInsideBlock(nn.Module):
    """Each block scales the gradient of its own hidden state with a hook."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(W, 2 * W), nn.Linear(2 * W, W)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.gelu(self.up(x))
            h.register_hook(lambda g: g * 0.9)
            return x + self.down(h)

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(self.Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _data(*shape: int) -> Callable[[], tuple[tuple, dict]]:
    return lambda: ((torch.randn(*shape),), {})


HABIT_CASES = [
    PyCase("stats_dict_and_float_history", StatsDict,
           state=lambda m: (dict(m.stats), list(m.history))),
    PyCase("moco_queue_with_int_pointer", MocoQueue, state=lambda m: m.ptr, steps=5),
    PyCase("print_of_a_tensor_to_a_stream", PrintsToLog, state=lambda m: m.out.getvalue()),
    PyCase("namedtuple_config_replaced", NamedTupleConfig,
           between=lambda m: setattr(m, "cfg", m.cfg._replace(scale=0.5))),
    PyCase("property_over_a_changed_field", PropertyConfig,
           between=lambda m: setattr(m.cfg, "base", 6.0)),
    PyCase("enum_mode_switched", EnumMode, between=lambda m: setattr(m, "mode", Mode.GATED)),
    PyCase("partial_activation_swapped", PartialActivation,
           between=lambda m: setattr(m, "act", functools.partial(F.leaky_relu,
                                                                 negative_slope=0.3))),
    PyCase("plain_tensor_attribute_replaced", TensorAttribute,
           between=lambda m: setattr(m, "weights", torch.linspace(2.0, 0.0, W))),
    PyCase("float_and_flag_keywords_per_step", ScaledCall, steps=4,
           call_kwargs=({}, {"scale": 0.5}, {"scale": 0.25, "clip": True}, {"scale": 2.0})),
    PyCase("layers_sliced_by_a_growing_count", Growing,
           between=lambda m: setattr(m, "active", 4)),
    PyCase("block_frozen_between_steps", Body, between=_freeze_first_block),
    PyCase("load_state_dict_assign", Body, between=_assign_state),
    PyCase("batchnorm_alone_put_in_eval", WithNorm, between=_freeze_norm),
    PyCase("pre_hook_with_kwargs_added", WithNorm, between=_kwargs_pre_hook),
    PyCase("item_decides_the_branch", ItemBranch, steps=4,
           per_step=lambda step: ((torch.randn(8, W, requires_grad=True),), {})),
    PyCase("noise_from_an_owned_generator", OwnGenerator,
           state=lambda m: m.gen.get_state().sum().item()),
    PyCase("scripted_function_called", ScriptedFunction),
    # the model's own torch.utils.checkpoint on a data batch (Dynamo makes each call one op that
    # runs non-reentrant; eager's reentrant one leaves a call on data without gradients)
    PyCase("reentrant_checkpoint_per_block_on_data", lambda: DataCheckpointed(True),
           inputs=_data(8, W)),
    PyCase("reentrant_checkpoint_at_root_on_data", lambda: DataCheckpointed(True, True),
           inputs=_data(8, W)),
    PyCase("checkpoint_without_use_reentrant_on_data", lambda: DataCheckpointed(None),
           inputs=_data(8, W)),
    PyCase("non_reentrant_checkpoint_on_data", lambda: DataCheckpointed(False),
           inputs=_data(8, W)),
    PyCase("reentrant_checkpoint_data_and_a_parameter_input", MixedCheckpointInputs,
           inputs=_data(8, W)),
    # hooks registered on tensors in the forward (Dynamo makes each one op: never recomputed,
    # or it would be registered again on the recomputed tensor and fire twice)
    PyCase("tensor_hook_scales_a_gradient", GradHalved),
    PyCase("tensor_hook_logs_gradient_norms", GradNormsLogged, state=lambda m: list(m.norms)),
    PyCase("tensor_hook_inside_each_block", HookInsideBlock),
]
"""Run with :data:`dynamo_patterns.DYNAMO_CASES` by ``tests/dynamo/test_dynamo_facts.py``."""
