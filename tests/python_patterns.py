"""Python facts a captured graph could bake in, in the forms users write them.

Each :class:`Case` is a small model doing one thing real code does with Python around its
tensors: a ``torch.no_grad()`` island (an EMA teacher, a DINO centre, a VQ-VAE codebook), an
autocast island, a temperature or a flag changed between steps, a head replaced after the first
step, an attention map stored on the module, noise drawn from a generator the model owns, a
nested ``torch.utils.checkpoint``, a float argument of ``-0.0``. ``tests/test_python_facts.py``
runs each through the unmodified model and through ``fxckpt.transform`` with every strategy and
both capture methods and asserts the same bits after every step (outputs, input and parameter
gradients, buffers, the attributes the case names), or the documented error.

``between(model)`` is applied to both models after the first step (what a training loop does
between steps).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import random
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt

from fxckpt.errors import CaptureError

W = 32


def _x(*shape: int) -> Callable[[], tuple[tuple, dict]]:
    return lambda: ((torch.randn(*shape, requires_grad=True),), {})


class Body(nn.Module):
    """Three residual MLP blocks: something for every strategy to checkpoint."""

    def __init__(self, width: int = W, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


# -- grad-mode regions ---------------------------------------------------------------------------

class NoGradIsland(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.gate = Body(), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        with torch.no_grad():
            g = torch.sigmoid(self.gate(h))
        return h * g


@torch.no_grad()
def _frozen_scores(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return torch.softmax(layer(h), -1)


class NoGradDecorated(nn.Module):
    """``@torch.no_grad()`` on a helper function."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.scorer = Body(), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return h * _frozen_scores(self.scorer, h)


class NoGradMethod(nn.Module):
    """``@torch.no_grad()`` on a method of the model."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.probe = Body(), nn.Linear(W, 1)

    @torch.no_grad()
    def confidence(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.probe(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return h * self.confidence(h)


class SetGradFunction(nn.Module):
    """``torch.set_grad_enabled(False)`` ... ``(True)`` as plain calls."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.side = Body(), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        torch.set_grad_enabled(False)
        s = self.side(h)
        torch.set_grad_enabled(True)
        return h + s


class SetGradContext(nn.Module):
    """``with torch.set_grad_enabled(self.train_side):`` read from an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.side = Body(), nn.Linear(W, W)
        self.train_side = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        with torch.set_grad_enabled(self.train_side):
            s = self.side(h)
        return h + s


class EnableGradInside(nn.Module):
    """``enable_grad`` inside ``no_grad``: only the inner part is differentiable."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.a, self.b = Body(), nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        with torch.no_grad():
            frozen = self.a(h)
            with torch.enable_grad():
                live = self.b(h)
        return frozen * live


class EMATeacher(nn.Module):
    """A student and an EMA teacher updated in place under no_grad every step (BYOL / DINO)."""

    def __init__(self) -> None:
        super().__init__()
        self.student, self.teacher = Body(), Body()
        self.teacher.load_state_dict(self.student.state_dict())
        for p in self.teacher.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.student(x)
        with torch.no_grad():
            for pt, ps in zip(self.teacher.parameters(), self.student.parameters()):
                pt.mul_(0.99).add_(ps.detach(), alpha=0.01)
            t = self.teacher(x)
        return (s - t).pow(2)


class DinoCentre(nn.Module):
    """A centre buffer updated with an EMA of the batch mean, under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.register_buffer("center", torch.zeros(W))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        out = torch.softmax((h - self.center) / 0.1, -1)
        with torch.no_grad():
            self.center.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return out


class CentreReadAfter(nn.Module):
    """A buffer written in place inside a grad-mode region, then read after it (DINO's centre as
    users write it), in the forms users write the write: ``mul_``/``add_``, ``copy_``, ``lerp_``,
    a slice assignment, a ``@torch.no_grad()`` method, ``torch.set_grad_enabled(False)``."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.body, self.head = Body(), nn.Linear(W, W)
        self.register_buffer("center", torch.zeros(W))

    @torch.no_grad()
    def update_center(self, h: torch.Tensor) -> None:
        self.center.mul_(0.9).add_(0.1 * h.mean(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if self.form == "method":
            self.update_center(h)
        elif self.form == "set_grad_enabled":
            torch.set_grad_enabled(False)
            self.center.mul_(0.9).add_(0.1 * h.mean(0))
            torch.set_grad_enabled(True)
        else:
            with torch.no_grad():
                if self.form == "mul_add":
                    self.center.mul_(0.9).add_(0.1 * h.mean(0))
                elif self.form == "copy":
                    self.center.copy_(h.mean(0))
                elif self.form == "lerp":
                    self.center.lerp_(h.mean(0), 0.1)
                elif self.form == "slice":
                    self.center[:] = 0.5 * self.center + 0.5 * h.mean(0)
        h = h - self.center
        return self.head(torch.relu(h))


class VQCodebook(nn.Module):
    """VQ-VAE: nearest code, straight-through, codebook EMA update under no_grad."""

    def __init__(self, codes: int = 16) -> None:
        super().__init__()
        self.enc, self.dec = Body(depth=2), Body(depth=2)
        self.register_buffer("codebook", torch.randn(codes, W))
        self.register_buffer("usage", torch.zeros(codes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.enc(x)
        idx = torch.cdist(z, self.codebook).argmin(-1)
        q = self.codebook[idx]
        with torch.no_grad():
            onehot = F.one_hot(idx, self.codebook.shape[0]).to(z.dtype)
            self.usage.mul_(0.99).add_(onehot.sum(0), alpha=0.01)
            means = onehot.t() @ z / (onehot.sum(0)[:, None] + 1)
            self.codebook.mul_(0.99).add_(means, alpha=0.01)
        q = z + (q - z).detach()
        return self.dec(q) + 0.25 * (z - q.detach()).pow(2)


class FrozenEmbeddingLookup(nn.Module):
    """A frozen lookup computed under no_grad in a submodule's own forward."""

    class Lookup(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Linear(W, W)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return self.table(x).tanh()

    def __init__(self) -> None:
        super().__init__()
        self.lookup, self.body = self.Lookup(), Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x + self.lookup(x))


class NoGradAroundDropout(nn.Module):
    """Random numbers drawn inside a no_grad island (a noisy target)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.target = Body(), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        with torch.no_grad():
            t = F.dropout(self.target(x), 0.3, self.training)
        return (h - t).pow(2)


class GradModeLeftOff(nn.Module):
    """Turns gradients off and never back on: no graph can leave the caller's mode changed."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        torch.set_grad_enabled(False)
        return h


# -- autocast regions ----------------------------------------------------------------------------

class Bf16Island(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.proj = Body(), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            p = self.proj(h)
        return h + p.float()


class Fp32Island(nn.Module):
    """``autocast(enabled=False)`` around a softmax, for a caller that runs under autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.q = Body(), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        with torch.autocast("cpu", enabled=False):
            a = torch.softmax(self.q(h.float()) * 0.5, -1)
        return h * a


@torch.autocast("cpu", dtype=torch.bfloat16)
def _half_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


class AutocastDecorated(nn.Module):
    """``@torch.autocast(...)`` on a helper."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.w = nn.Parameter(torch.randn(W, W) / W**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return h + _half_matmul(h, self.w).float()


class NestedAutocast(nn.Module):
    """A bf16 region with an fp32 hole inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.a, self.b = Body(), nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            u = self.a(h)
            with torch.autocast("cpu", enabled=False):
                v = self.b(u.float())
            w = u * v
        return h + w.float()


class AutocastAndNoGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.a = Body(), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                t = self.a(h)
        return h * t.float()


# -- attributes changed between steps ------------------------------------------------------------

class Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.body(x) / self.temperature, -1)


class Gated(nn.Module):
    """A bool flag choosing a branch (a curriculum switch)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.extra = Body(), nn.Linear(W, W)
        self.use_extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if self.use_extra:
            h = h + self.extra(h)
        return h


class TopK(nn.Module):
    """An int read for a shape-changing op."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.k = 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return torch.topk(h, self.k, -1).values


class Pooled(nn.Module):
    """A string mode."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.pool = "mean"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return h.mean(-1) if self.pool == "mean" else h.amax(-1)


class Mode(enum.Enum):
    SUM = "sum"
    PROD = "prod"


class EnumMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.mode = Mode.SUM

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return h + x if self.mode is Mode.SUM else h * x


class TupleAttr(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.scales = (1.0, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return h * self.scales[0] + h.tanh() * self.scales[1]


@dataclasses.dataclass
class Settings:
    scale: float = 1.0
    residual: bool = True


class WithSettings(nn.Module):
    """A config object kept on the model (Hugging Face keeps one on every module)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.settings = Settings()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x) * self.settings.scale
        return h + x if self.settings.residual else h


class ClassDefault(nn.Module):
    """A class attribute read as a default, shadowed on the instance later."""

    margin = 0.5

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) - self.margin)


class ActivationChoice(nn.Module):
    """A function kept as an attribute (``self.act = F.gelu``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.act: Callable[[torch.Tensor], torch.Tensor] = F.gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.body(x))


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.drop, self.head = Body(), nn.Dropout(0.1), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.body(x)))


class WithHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = Body(), nn.Linear(W, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class MaskedAttr(nn.Module):
    """A plain tensor attribute (not a buffer) rebound between steps."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.mask = torch.ones(W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.mask


class Scheduled(nn.Module):
    """A noise scale a training loop sets every step."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.noise = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return h + self.noise * torch.randn_like(h)


class PlainTensorCounter(nn.Module):
    """A tensor kept as a plain attribute (not a buffer), updated in place every call."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.seen = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(1)
        return self.body(x) / self.seen


@dataclasses.dataclass
class Inner:
    gain: float = 1.0


@dataclasses.dataclass
class Nested:
    inner: Inner = dataclasses.field(default_factory=Inner)


class NestedSettings(nn.Module):
    """A config holding a config (Hugging Face's ``config.text_config``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.settings = Nested()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.settings.inner.gain


class Weighted(nn.Module):
    """A dict and a list of plain values, changed in place."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.weights = {"main": 1.0, "aux": 0.5}
        self.dims = [-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return h * self.weights["main"] + h.mean(self.dims, keepdim=True) * self.weights["aux"]


# -- attributes assigned in forward --------------------------------------------------------------

class StoresAttention(nn.Module):
    """Keeps its last attention map for visualisation (``self.attn_map = ...``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.q, self.k = Body(), nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        attn = torch.softmax(self.q(h) @ self.k(h).transpose(-1, -2), -1)
        self.attn_map = attn.detach()
        return attn @ h


class StoresInChild(nn.Module):
    """A child stores what it computed; the model reads it after the call."""

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(W, W)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            self.last_norm = y.norm(dim=-1).detach()
            self.seen = True
            return y

    def __init__(self) -> None:
        super().__init__()
        self.body, self.probe = Body(), self.Probe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.probe(self.body(x))


class StoresAuxLoss(nn.Module):
    """A mixture-of-experts style auxiliary loss kept on the module, with its graph."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.router = Body(), nn.Linear(W, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        probs = torch.softmax(self.router(h), -1)
        self.aux_loss = probs.mean(0).pow(2).sum()
        return h * probs.max(-1, keepdim=True).values


class CountsCalls(nn.Module):
    """A Python counter: no graph can replay it (refused, as before)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.body(x)


# -- randomness ----------------------------------------------------------------------------------

class OwnGenerator(nn.Module):
    """Noise from a generator the model owns, inside what strategies checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Body(depth=2), Body(depth=2)
        self.gen = torch.Generator().manual_seed(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x + 0.1 * torch.randn(x.shape, generator=self.gen))
        return self.b(h + 0.1 * torch.randn(h.shape, generator=self.gen))


class ConstantShapeNoise(nn.Module):
    """Noise whose shape no input gives (``torch.randn(8, W)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x + 0.1 * torch.randn(8, W))


class BernoulliMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return h * torch.bernoulli(torch.full_like(h, 0.7))


class RReLUNet(nn.Module):
    """RReLU as the last saving op of a block (torch's early stop mishandles it)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(W, W), nn.RReLU()) for _ in range(3))
        self.head = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class NumpyNoise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x * float(np.random.uniform(0.9, 1.1)))


class PythonChoice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * random.choice([0.5, 1.0])


class HeldNumpyGenerator(nn.Module):
    """A numpy Generator the model owns (``self.rng = np.random.default_rng(0)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.rng = np.random.default_rng(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * float(self.rng.uniform(0.9, 1.1))


class HeldPythonRandom(nn.Module):
    """A ``random.Random`` the model owns, for a per-call jitter."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.rand = random.Random(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.rand.uniform(0.9, 1.1)


class HeldRandomState(nn.Module):
    """A legacy ``np.random.RandomState`` in a dict of generators the model keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.rngs = {"scale": np.random.RandomState(0)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * float(self.rngs["scale"].uniform(0.9, 1.1))


class Jitter:
    """An augmentation helper with its own numpy Generator (a plain object, not a module)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * float(self.rng.normal(1.0, 0.05))


class HelperWithGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.jitter = Jitter(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.jitter(x))


@functools.lru_cache(maxsize=8)
def _decay_table(n: int) -> torch.Tensor:
    """A table built from constants and memoised, as rotary or ALiBi tables are."""
    return torch.linspace(1.0, 0.5, n)


def _method_cache(fn: Callable) -> Callable:
    """Hugging Face's compile_compatible_method_lru_cache, in short: a wrapper over a cache."""
    cached = functools.lru_cache(maxsize=4)(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any) -> Any:
        return cached(*args)

    wrapper.empty = cached.cache_clear  # type: ignore[attr-defined]
    return wrapper


class CachedTables(nn.Module):
    """Tensors built from constants and memoised: by a module-level ``lru_cache`` function and by
    a cached static method (BEiT's relative position index)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.width = W  # a size from the config, as BEiT's window size is
        _decay_table.cache_clear()  # as in a fresh process: the first call fills the caches
        CachedTables.position_index.empty()  # type: ignore[attr-defined]

    @staticmethod
    @_method_cache
    def position_index(n: int) -> torch.Tensor:
        return torch.arange(n).flip(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.width
        h = self.body(x) * _decay_table(n)
        return h + h[..., self.position_index(n)]


class LayerDrop(nn.Module):
    """A random Python decision per layer (LayerDrop / stochastic depth)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.body.blocks:
            if self.training and torch.rand([]) < 0.2:
                continue
            x = x + b(x)
        return x


class StochasticDepthTensor(nn.Module):
    """Stochastic depth done with tensors (``torchvision.ops.stochastic_depth``'s way)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.body.blocks:
            keep = torch.empty(x.shape[0], 1).bernoulli_(0.8) / 0.8
            x = x + b(x) * keep
        return x


# -- nested checkpoints --------------------------------------------------------------------------

class CheckpointingBody(Body):
    """A body that checkpoints each of its blocks itself."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + ckpt.checkpoint(b, x, use_reentrant=self.reentrant)
        return x


class InnerCheckpoint(nn.Module):
    """``torch.utils.checkpoint`` called by a child, or by the model's own forward."""

    def __init__(self, reentrant: bool, at_root: bool) -> None:
        super().__init__()
        self.reentrant, self.at_root = reentrant, at_root
        self.body = Body() if at_root else CheckpointingBody(reentrant)
        self.head = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.at_root:
            h = ckpt.checkpoint(self.body, x, use_reentrant=self.reentrant)
        else:
            h = self.body(x)
        return self.head(h)


class CheckpointedBlock(nn.Module):
    """A block that checkpoints itself inside its own forward (a common hand-made pattern)."""

    class Block(nn.Module):
        def __init__(self, reentrant: bool) -> None:
            super().__init__()
            self.ff = nn.Sequential(nn.Linear(W, 2 * W), nn.GELU(), nn.Linear(2 * W, W))
            self.reentrant = reentrant

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + ckpt.checkpoint(self.ff, x, use_reentrant=self.reentrant)

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(self.Block(reentrant) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


class SequentialCheckpoint(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(*[nn.Sequential(nn.Linear(W, W), nn.Tanh()) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ckpt.checkpoint_sequential(self.seq, 2, x, use_reentrant=False)


def _halved(grad: torch.Tensor) -> torch.Tensor:
    return grad * 0.5


class TensorHooked(Body):
    """A hook the forward registers on a hidden state it computes (scales its gradient)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, b in enumerate(self.blocks):
            x = x + b(x)
            if i == 0:
                x.register_hook(_halved)
        return x


# -- non-tensor arguments ------------------------------------------------------------------------

class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()

    def forward(self, x: torch.Tensor, scale: float = 1.0, flip: bool = False) -> torch.Tensor:
        h = self.body(x)
        if scale == scale:  # not NaN: NaN means "unscaled" here
            h = h * scale
        return -h if flip else h


# -- the cases -----------------------------------------------------------------------------------

Error = tuple[type, str]


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the harness."""

    name: str
    make: Callable[[], nn.Module]
    inputs: Callable[[], tuple[tuple, dict]] = _x(8, W)
    between: Optional[Callable[[nn.Module], None]] = None
    """What the training loop changes after the first step (applied to both models)."""
    error: Optional[Error] = None
    """The documented refusal, on both capture methods."""
    export_error: Optional[Error] = None
    """The refusal under ``capture="export"`` only (symbolic_trace is exact)."""
    symbolic_error: Optional[Error] = None
    """The refusal under ``capture="symbolic_trace"`` only (export is exact, and ``auto`` falls
    back to it)."""
    attributes: tuple[str, ...] = ()
    """Attributes the forward sets, compared after every step (``probe.last_norm``)."""
    depth: int = 2
    budget: float = 0.7
    steps: int = 3
    call_kwargs: tuple[dict, ...] = ()
    """Per-step keyword arguments (non-tensor arguments changing between calls)."""


def _set(path: str, value: Any) -> Callable[[nn.Module], None]:
    def change(model: nn.Module) -> None:
        owner, _, name = path.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, name, value)
    return change


def _new_head(model: nn.Module) -> None:
    torch.manual_seed(11)  # both models get the same new head
    model.head = nn.Linear(W, 8)


def _new_weight(model: nn.Module) -> None:
    torch.manual_seed(12)
    model.head.weight = nn.Parameter(torch.randn(8, W) * 0.1)


def _new_block(model: nn.Module) -> None:
    torch.manual_seed(13)
    model.body.blocks[1] = nn.Sequential(nn.Linear(W, 2 * W), nn.Tanh(), nn.Linear(2 * W, W))


def _settings(model: nn.Module) -> None:
    model.settings.scale = 0.5
    model.settings.residual = False


def _reseed(model: nn.Module) -> None:
    model.gen = torch.Generator().manual_seed(99)


_NUMPY = (CaptureError, r"numpy's global random generator \(np\.random\.uniform\(\)")
_PYTHON = (CaptureError, r"Python's `random` module \(random\.choice\(\)")
_EXPORT_ASSIGN = (CaptureError, r"assigns a tensor it computes to `")
_EXPORT_GENERATOR = (CaptureError, r"draws from a torch.Generator it owns \(OwnGenerator.gen\)")

CASES = [
    # grad-mode regions
    Case("no_grad_island", NoGradIsland),
    Case("no_grad_decorated_helper", NoGradDecorated),
    Case("no_grad_decorated_method", NoGradMethod),
    Case("set_grad_enabled_calls", SetGradFunction),
    Case("set_grad_enabled_from_attribute", SetGradContext,
         between=_set("train_side", True)),
    Case("enable_grad_inside_no_grad", EnableGradInside),
    Case("ema_teacher", EMATeacher, symbolic_error=(
        CaptureError, r"writes the model's parameters, buffers or tensor attributes in place")),
    Case("dino_centre", DinoCentre),
    Case("vq_codebook", VQCodebook),
    *(Case(f"centre_{form}_read_after", functools.partial(CentreReadAfter, form))
      for form in ("mul_add", "copy", "lerp", "method", "set_grad_enabled")),
    Case("centre_slice_read_after", functools.partial(CentreReadAfter, "slice"), symbolic_error=(
        CaptureError, r"'Proxy' object does not support item assignment")),
    Case("no_grad_in_child_forward", FrozenEmbeddingLookup),
    Case("dropout_inside_no_grad", NoGradAroundDropout),
    Case("grad_mode_left_off", GradModeLeftOff,
         error=(CaptureError, r"turns gradients off \(torch.set_grad_enabled\) and leaves them")),
    # autocast regions
    Case("bf16_island", Bf16Island),
    Case("fp32_island", Fp32Island),
    Case("autocast_decorated_helper", AutocastDecorated),
    Case("nested_autocast", NestedAutocast),
    Case("autocast_around_no_grad", AutocastAndNoGrad, export_error=(
        CaptureError, r"changes grad mode inside a torch.autocast block")),
    # attributes changed between steps
    Case("temperature_changed", Tempered, between=_set("temperature", 0.25)),
    Case("temperature_to_negative_zero", Tempered, between=_set("temperature", -1.0)),
    Case("flag_turns_branch_on", Gated, between=_set("use_extra", True)),
    Case("int_changes_shape", TopK, between=_set("k", 7)),
    Case("string_mode_changed", Pooled, between=_set("pool", "max")),
    Case("enum_mode_changed", EnumMode, between=_set("mode", Mode.PROD)),
    Case("tuple_attribute_changed", TupleAttr, between=_set("scales", (0.5, 3.0))),
    Case("config_object_changed", WithSettings, between=_settings),
    Case("config_object_replaced", WithSettings, between=_set("settings", Settings(2.0, False))),
    Case("class_default_shadowed", ClassDefault, between=_set("margin", 0.1)),
    Case("activation_function_swapped", ActivationChoice, between=_set("act", torch.tanh)),
    Case("dropout_p_changed", DropoutNet, between=_set("drop.p", 0.6)),
    Case("dropout_turned_off", DropoutNet, between=lambda m: m.drop.eval()),
    Case("head_replaced", WithHead, between=_new_head),
    Case("parameter_replaced", WithHead, between=_new_weight),
    Case("block_replaced", WithHead, between=_new_block),
    Case("tensor_attribute_rebound", MaskedAttr, between=_set("mask", torch.linspace(0, 1, W))),
    Case("noise_scale_scheduled", Scheduled, between=_set("noise", 0.5)),
    Case("int_set_to_same_value_as_float", TopK, between=_set("k", 4)),
    Case("nested_config_changed", NestedSettings,
         between=lambda m: setattr(m.settings.inner, "gain", 3.0)),
    Case("dict_attribute_changed_in_place", Weighted,
         between=lambda m: m.weights.__setitem__("aux", 2.0)),
    Case("list_attribute_changed_in_place", Weighted, between=lambda m: m.dims.append(0)),
    Case("partial_activation_swapped", ActivationChoice,
         between=_set("act", functools.partial(F.leaky_relu, negative_slope=0.2))),
    Case("plain_tensor_attribute_updated_in_place", PlainTensorCounter, symbolic_error=(
        CaptureError, r"writes the model's parameters, buffers or tensor attributes in place")),
    # attributes assigned in forward
    Case("stores_attention_map", StoresAttention, attributes=("attn_map",),
         export_error=_EXPORT_ASSIGN),
    Case("child_stores_what_it_computed", StoresInChild,
         attributes=("probe.last_norm", "probe.seen"), export_error=_EXPORT_ASSIGN),
    Case("stores_aux_loss", StoresAuxLoss, attributes=("aux_loss",),
         export_error=_EXPORT_ASSIGN),
    Case("python_counter", CountsCalls, error=(CaptureError, r"changes `calls` \(from 0 to 1\)")),
    # randomness
    Case("own_generator", OwnGenerator, export_error=_EXPORT_GENERATOR),
    Case("own_generator_replaced", OwnGenerator, between=_reseed,
         export_error=_EXPORT_GENERATOR),
    Case("constant_shape_noise", ConstantShapeNoise),
    Case("bernoulli_mask", BernoulliMask),
    Case("rrelu_last_in_block", RReLUNet, depth=2),
    Case("numpy_global_draw", NumpyNoise, error=_NUMPY),
    Case("python_random_choice", PythonChoice, error=_PYTHON),
    Case("numpy_generator_held", HeldNumpyGenerator,
         error=(CaptureError, r"reads `<root>.rng`, a numpy.random._generator.Generator random")),
    Case("python_random_held", HeldPythonRandom,
         error=(CaptureError, r"reads `<root>.rand`, a random.Random random generator")),
    Case("numpy_random_state_in_dict", HeldRandomState,
         error=(CaptureError, r"reads `<root>\.rngs\['scale'\]`, a numpy\.random\.mtrand\."
                r"RandomState random generator, and draws from it")),
    Case("numpy_generator_in_helper", HelperWithGenerator,
         error=(CaptureError, r"reads `<root>\.jitter\.rng`, a numpy\.random\._generator\."
                r"Generator random generator, and draws from it")),
    Case("cached_constant_tables", CachedTables),
    Case("layer_drop_decision", LayerDrop,
         error=(CaptureError, r"could not capture LayerDrop")),
    Case("stochastic_depth_tensors", StochasticDepthTensor,
         symbolic_error=(CaptureError, r"symbolic_trace failed with TypeError: empty\(\)")),
    # nested checkpoints
    # a reentrant checkpoint is one opaque call: no plan goes below the unmodified peak
    Case("reentrant_checkpoint_in_child", lambda: InnerCheckpoint(True, False), budget=1.0,
         export_error=(CaptureError, r"use_reentrant=True\) \(in body\), which torch.export")),
    Case("reentrant_checkpoint_at_root", lambda: InnerCheckpoint(True, True), budget=1.0,
         export_error=(CaptureError, r"use_reentrant=True\) \(in <root>\), which torch.export")),
    Case("checkpoint_in_child", lambda: InnerCheckpoint(False, False)),
    Case("checkpoint_at_root", lambda: InnerCheckpoint(False, True)),
    Case("block_checkpoints_itself_reentrant", lambda: CheckpointedBlock(True), budget=1.0,
         export_error=(CaptureError, r"use_reentrant=True\) \(in blocks.0, blocks.1, blocks.2\)")),
    Case("block_checkpoints_itself", lambda: CheckpointedBlock(False)),
    Case("checkpoint_sequential_inside", SequentialCheckpoint, budget=0.95),
    # a hook on a tensor: torch.export drops it (refused by name), symbolic_trace cannot record
    # a function argument; Dynamo keeps it (one op, never recomputed)
    Case("hook_on_a_tensor_in_forward", TensorHooked,
         export_error=(CaptureError, r"registers a hook on a tensor it computes"),
         symbolic_error=(CaptureError, r"NotImplementedError: argument of type")),
    # non-tensor arguments
    Case("float_argument_signed_zero", Scaled,
         call_kwargs=({"scale": 0.0}, {"scale": -0.0}, {"scale": 0.0})),
    Case("float_argument_nan", Scaled,
         call_kwargs=({"scale": float("nan")}, {"scale": float("nan")}, {"scale": 2.0})),
    Case("bool_argument_flips", Scaled,
         call_kwargs=({"flip": False}, {"flip": True}, {"flip": False})),
]
"""Every case: ``tests/test_python_facts.py`` runs each with every strategy on both captures."""
