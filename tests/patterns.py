"""Small models, each exercising one way a captured graph can silently diverge from the model.

The differential harness (``tests/test_fidelity.py``) runs every :data:`PATTERNS` entry eager and
transformed, two training steps, with every strategy, and asserts the same bits — or, for what no
graph can replay, the documented error. Each model is the smallest form of something real code
does: a straight-through estimator (custom autograd Function), a step counter in a buffer,
SpecAugment-style numpy masks, a frozen submodule in eval mode, activation hooks.
"""

from __future__ import annotations

import dataclasses
import random
import warnings
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxckpt.errors import CaptureError


class RoundSTE(torch.autograd.Function):
    """Straight-through estimator: rounds in forward, passes the gradient unchanged in backward
    (autograd of the forward would give zero gradients)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g


class Quantized(nn.Module):
    """A block whose activations go through the straight-through estimator."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(RoundSTE.apply(self.fc(x) * 4) / 4)


class QuantizedNet(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Quantized(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class ExportOnly(nn.Module):
    """Python ints from shapes (``int(x.shape[1])``) defeat symbolic_trace: export captures it."""

    def __init__(self, inner: nn.Module, width: int = 16) -> None:
        super().__init__()
        self.inner = inner
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert int(x.shape[1]) == self.width
        return self.inner(x)


class RootFunction(nn.Module):
    """Calls a custom Function in its own forward; export-only, so there is no module to keep."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = int(x.shape[0])
        return RoundSTE.apply(self.fc(x) * n)


class Decay(nn.Module):
    """Counts its calls in a buffer and scales by ``0.5 ** step`` (a schedule kept in the
    model)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.register_buffer("step", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step.add_(1)
        return torch.tanh(self.fc(x)) * (0.5 ** self.step)


class DecayNet(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.a, self.b = Decay(width), Decay(width)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(x)))


class NumpyMask(nn.Module):
    """SpecAugment-style: a mask drawn with numpy in training (what Wav2Vec2 does)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            keep = torch.tensor(np.random.rand(x.shape[-1]) > 0.2, dtype=x.dtype)
            x = x * keep
        return self.fc(x)


class PythonRandom(nn.Module):
    """Picks a scale with Python's ``random`` each call."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * random.choice([0.5, 1.0, 2.0])


class Counting(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x) * (1.0 + 0.1 * self.calls)


class CountingNet(nn.Module):
    """A submodule keeps a Python counter and uses it (baked into any graph as a constant)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.counter = Counting(width)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.counter(x))


class PartlyFrozen(nn.Module):
    """The user froze the stem in eval mode (BatchNorm statistics fixed, no dropout there)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.3)
        )
        self.body = nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.3)
        )
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)).mean((2, 3)))


def partly_frozen() -> nn.Module:
    model = PartlyFrozen().train()
    model.stem.eval()
    return model


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class Stack(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class Tempered(nn.Module):
    """A stack divided by a temperature kept as a plain attribute (a schedule changes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Stack()
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) / self.temperature


class HookLog:
    """Counts hook calls per module and checks they saw real tensors."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def attach(self, model: nn.Module, path: str) -> None:
        module = model.get_submodule(path)

        def pre(mod: nn.Module, args: tuple) -> None:
            assert type(args[0]) is torch.Tensor, f"hook saw {type(args[0]).__name__}"
            self.calls[path + ":pre"] = self.calls.get(path + ":pre", 0) + 1

        def post(mod: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            assert type(out) is torch.Tensor, f"hook saw {type(out).__name__}"
            self.calls[path] = self.calls.get(path, 0) + 1
            return out * 1.5  # a hook that changes the output

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


def hooked_stack() -> nn.Module:
    model = Stack()
    log = HookLog()
    log.attach(model, "blocks.1")
    model.hook_log = log  # type: ignore[assignment]
    return model


def hooked_export_only() -> nn.Module:
    model = ExportOnly(Stack())
    log = HookLog()
    log.attach(model, "inner.blocks.1")
    model.hook_log = log  # type: ignore[assignment]
    return model


class Encoder(nn.Module):
    """A stack of ``nn.TransformerEncoderLayer`` (leaf modules for symbolic_trace)."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.1, batch_first=True)
            for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Normed(nn.Module):
    """Weight normalisation: the old ``weight_norm`` recomputes the weight from ``g`` and ``v``
    in a forward pre-hook every call; the new one is a parametrization (a property)."""

    def __init__(self, width: int = 16, hooked: bool = True) -> None:
        super().__init__()
        if hooked:
            with warnings.catch_warnings():
                warnings.simplefilter(
                    "ignore", FutureWarning
                )  # deprecated, and still in real code
                self.fc = torch.nn.utils.weight_norm(  # type: ignore[attr-defined]
                    nn.Linear(width, width)
                )
        else:
            self.fc = torch.nn.utils.parametrizations.weight_norm(nn.Linear(width, width))
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class ClippedQKV(nn.Module):
    """OLMo-style ``clip_qkv``: projections clamped in place right after they are made."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.q, self.k, self.v = (
            nn.Linear(width, width),
            nn.Linear(width, width),
            nn.Linear(width, width),
        )
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        q.clamp_(-0.5, 0.5)
        k.clamp_(-0.5, 0.5)
        v.clamp_(-0.5, 0.5)
        return x + self.out(torch.softmax(q @ k.transpose(-1, -2), -1) @ v)


class ClippedStack(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ClippedQKV(width) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


class Tied(nn.Module):
    """An embedding tied to the output projection (TESTCASES 11)."""

    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.body = Stack(width, 2)
        self.out = nn.Linear(width, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> dict:
        h = self.body.blocks[1](self.body.blocks[0](self.emb(ids)))
        return {"logits": self.out(h), "n": ids.shape[0], "tag": "lm"}


@dataclasses.dataclass(frozen=True)
class Pattern:
    """One row of the harness: a model, its inputs, and what fxckpt must do with it."""

    name: str
    make: Callable[[], nn.Module]
    inputs: Callable[[], tuple[tuple, dict]]
    depth: int = 2
    budget: float = 0.8
    error: Optional[tuple[type, str]] = None
    """``(error type, regex the message must match)`` when the pattern must be refused."""


def _x(*shape: int, grad: bool = True) -> Callable[[], tuple[tuple, dict]]:
    return lambda: ((torch.randn(*shape, requires_grad=grad),), {})


PATTERNS = [
    Pattern("custom_function", QuantizedNet, _x(4, 16)),
    Pattern("custom_function_export", lambda: ExportOnly(QuantizedNet()), _x(4, 16), depth=3),
    Pattern(
        "custom_function_at_root",
        RootFunction,
        _x(4, 16),
        depth=1,
        error=(CaptureError, r"calls the custom autograd Function\(s\) RoundSTE directly"),
    ),
    Pattern("buffer_update", DecayNet, _x(4, 16), depth=1, budget=0.95),
    Pattern("buffer_update_export", lambda: ExportOnly(DecayNet()), _x(4, 16), budget=0.95),
    Pattern(
        "numpy_random",
        NumpyMask,
        _x(4, 16),
        depth=1,
        error=(CaptureError, r"numpy's global random generator \(np\.random\.rand\(\) in forward"),
    ),
    Pattern(
        "python_random",
        PythonRandom,
        _x(4, 16),
        depth=1,
        error=(CaptureError, r"Python's `random` module \(random\.choice\(\) in forward"),
    ),
    Pattern(
        "python_counter",
        CountingNet,
        _x(4, 16),
        error=(CaptureError, r"changes `counter\.calls` \(from 0 to 1\)"),
    ),
    Pattern("frozen_submodule", partly_frozen, _x(2, 3, 8, 8), depth=1, budget=0.97),
    Pattern("hooks", hooked_stack, _x(4, 16)),
    Pattern("hooks_export", hooked_export_only, _x(4, 16), depth=3),
    Pattern("transformer_encoder_layers", Encoder, _x(2, 6, 16)),
    # budget=1.0: the hooked fc stays out of segments, so no plan of this tiny model goes lower
    # (verified minimum: 1.000 of the unmodified step; 0.976 parametrized).
    Pattern("weight_norm", Normed, _x(4, 16), depth=1, budget=1.0),
    Pattern(
        "weight_norm_parametrized", lambda: Normed(hooked=False), _x(4, 16), depth=1, budget=1.0
    ),
    Pattern("tied_weights_dict_out", Tied, lambda: ((torch.randint(0, 32, (2, 6)),), {})),
    Pattern("no_input_grad", Stack, _x(4, 16, grad=False)),
    Pattern("inplace_after_projection", ClippedStack, _x(2, 6, 16)),
]
